"""The trainer's side of generation: the HTTP client of the generation services (retries, failover, weight
versions), the trainer's own service as a child process, the weight push (each policy version exported
and loaded by every service, through disk or shared memory), and the typed record a rollout becomes once
sampled and scored. The trainer reaches a service only over HTTP; it never imports `serve`.
"""
