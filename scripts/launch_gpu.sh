#!/usr/bin/env bash
# Runs `python -m drgrpo_jax.train --config ...` as one JAX process per host (multi-node GPU), setting
# mesh.coordinator_address / mesh.num_processes / mesh.process_id for jax.distributed.initialize, and
# places the generation service(s).
#
#   scripts/launch_gpu.sh --config PATH [options] [-- section.key=value ...]
#
# Where the processes run (one of):
#   --hosts h1,h2,...     one process per host over ssh (`localhost` runs here); h1 is the coordinator
#   --slurm               inside an allocation: one `srun` task per node, ids from SLURM_PROCID
#   --local N             N processes on 127.0.0.1 on CPU with gloo collectives (tests, laptops)
# Options:
#   --gpus-per-host G     GPUs on each host (default 8)
#   --serve-gpus K        start K generation services (python -m drgrpo_jax.serve) on the first host, each on
#                         one of its last K GPUs (CPU processes with --local); the trainer there gets the rest
#   --serve-mesh SPEC     each started service spans several GPUs: tensor=T[,data=D] (drgrpo_jax.serve --mesh), so
#                         --serve-gpus counts GPUs and must be a multiple of T x D (--local: T x D CPU devices each)
#   --serve-url URL       use a running service instead (repeatable: drgrpo_jax.serve; SGLang, vLLM unverified)
#   --serve-batch-size B  --max-batch-size of the started services (see python -m drgrpo_jax.plan)
#   --serve-port P        first service port (default 30000); --coordinator-port P (default 8476)
#   --local-devices D     fake CPU devices per --local process (default 1)
#   --api-key-env NAME    the services' API key is in $NAME: services get --api-key-env NAME, trainers
#                         rollout.api_key_env=NAME; over ssh the value goes on stdin, never on a command line
#                         (printed commands show only the name). Required when services listen beyond loopback
#   --allow-unauthenticated  let services listen beyond loopback without a key (a network you trust)
#   --log-dir DIR         logs of every process and service (default launch_logs)
#   --python PY           interpreter on every host (default python3); --workdir DIR on remote hosts (default .)
#   --dry-run             print every command instead of running it
# Every trainer process samples and scores its share of each step's prompts from the services (process i
# starts at URL i mod n). Without --serve-gpus or --serve-url only a single process may run: it starts its own
# child service (several processes without rollout.urls stop with a config error naming it).
# The run's output_dir must be one path every host and service sees (NFS): process 0 writes each weight
# version there and tells every service to load it.
set -euo pipefail

config="" mode="" hosts="" local_procs=0 gpus_per_host=8 serve_gpus=0 serve_batch="" serve_port=30000
coord_port=8476 local_devices=1 log_dir=launch_logs py=python3 workdir=. dry_run=0 key_env="" open_service=0
serve_mesh="" serve_urls=() overrides=()
die() { echo "launch_gpu.sh: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --hosts) mode=hosts; hosts="$2"; shift 2 ;;
    --slurm) mode=slurm; shift ;;
    --local) mode=local; local_procs="$2"; shift 2 ;;
    --gpus-per-host) gpus_per_host="$2"; shift 2 ;;
    --serve-gpus) serve_gpus="$2"; shift 2 ;;
    --serve-mesh) serve_mesh="$2"; shift 2 ;;
    --serve-url) serve_urls+=("$2"); shift 2 ;;
    --serve-batch-size) serve_batch="$2"; shift 2 ;;
    --serve-port) serve_port="$2"; shift 2 ;;
    --coordinator-port) coord_port="$2"; shift 2 ;;
    --local-devices) local_devices="$2"; shift 2 ;;
    --log-dir) log_dir="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --api-key-env) key_env="$2"; shift 2 ;;
    --allow-unauthenticated) open_service=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; overrides=("$@"); break ;;
    *) die "unknown option $1 (see the header of scripts/launch_gpu.sh)" ;;
  esac
done
[[ -n "$config" ]] || die "--config: required"
[[ -n "$mode" ]] || die "one of --hosts, --slurm or --local is required"
for n in gpus_per_host serve_gpus serve_port coord_port local_devices local_procs; do
  [[ "${!n}" =~ ^[0-9]+$ ]] || die "--${n//_/-}: must be a non-negative integer, got '${!n}'"
done
[[ $serve_gpus -eq 0 || ${#serve_urls[@]} -eq 0 ]] || die "--serve-gpus and --serve-url: give one or the other"
# Devices per service: the product of --serve-mesh's sizes (drgrpo_jax.serve checks the rest of it).
serve_ways=1
if [[ -n "$serve_mesh" ]]; then
  [[ "$serve_mesh" =~ ^(tensor|data)=[1-9][0-9]*(,(tensor|data)=[1-9][0-9]*)?$ ]] || \
    die "--serve-mesh: must be tensor=T[,data=D], got '$serve_mesh'"
  for part in ${serve_mesh//,/ }; do serve_ways=$((serve_ways * ${part#*=})); done
  [[ $serve_gpus -ge 1 ]] || die "--serve-mesh: needs --serve-gpus (the GPUs its services span)"
fi
(( serve_gpus % serve_ways == 0 )) || \
  die "--serve-gpus: $serve_gpus GPUs do not split into services of $serve_ways (--serve-mesh $serve_mesh)"
if [[ -n "$key_env" ]]; then
  [[ "$key_env" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--api-key-env: '$key_env' is not an environment variable name"
  [[ -n "${!key_env:-}" ]] || die "--api-key-env: environment variable $key_env is not set or empty"
fi

# Quote one argument for display so that the printed line runs as is.
q() { if [[ "$1" == ">" || "$1" == "2>&1" || "$1" == "&" ]]; then printf '%s' "$1"; elif [[ "$1" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
show() { local out="" a; for a in "$@"; do out+="$(q "$a") "; done; echo "${out% }"; }
run() { show "$@"; [[ $dry_run -eq 1 ]] || "$@"; }
background() { show "$@" "&"; if [[ $dry_run -eq 0 ]]; then "$@" & pids+=($!); fi; }
pids=() serve_pids=()
# Remote commands that need the key read it from stdin first; the printed line shows `<<< "$NAME"`, not the value.
key_read=""; [[ -n "$key_env" ]] && key_read="IFS= read -r $key_env && export $key_env && "
keyed() {  # keyed CMD...: show and (unless --dry-run) run a remote command with the key on its stdin
  if [[ -n "$key_env" ]]; then echo "$(show "$@") <<< \"\$$key_env\""; else show "$@"; fi
  [[ $dry_run -eq 1 ]] && return 0
  if [[ -n "$key_env" ]]; then "$@" <<< "${!key_env}"; else "$@"; fi
}

case "$mode" in
  local) [[ $local_procs -ge 1 ]] || die "--local: needs at least 1 process"
         host_list=(); for ((i = 0; i < local_procs; i++)); do host_list+=(127.0.0.1); done ;;
  hosts) IFS=, read -r -a host_list <<< "$hosts"; [[ ${#host_list[@]} -ge 1 ]] || die "--hosts: empty list" ;;
  slurm) host_list=() ;;
esac
first_host="${host_list[0]:-}"
if [[ $mode == slurm && $serve_gpus -gt 0 ]]; then
  die "--serve-gpus: not with --slurm (start the services in their own job and pass --serve-url)"
fi
[[ $mode == local || $serve_gpus -lt $gpus_per_host ]] || die "--serve-gpus: $serve_gpus leaves no GPU for the trainer"

# The model the services load: model.path from the overrides, else from the config (drgrpo_jax.serve reads it).
# Weight pushes load only from the run's weights folder: drgrpo_jax.serve derives it from the config, or here
# from the overrides (run.weights_dir, else run.output_dir/weights).
model_args=() root_args=() out_root="" mirror_root=""
for o in "${overrides[@]}"; do
  [[ "$o" == model.path=* ]] && model_args=(--model "${o#model.path=}")
  [[ "$o" == run.output_dir=* ]] && out_root="${o#run.output_dir=}/weights"
  [[ "$o" == run.weights_dir=* ]] && mirror_root="${o#run.weights_dir=}"
done
[[ -n "$mirror_root$out_root" ]] && root_args=(--weights-root "${mirror_root:-$out_root}")

is_local() { [[ "$1" == localhost || "$1" == 127.0.0.1 ]]; }

[[ $dry_run -eq 1 ]] || mkdir -p "$log_dir"
# 1. Generation services on the first host (one per GPU, or CPU processes with --local).
if [[ $serve_gpus -gt 0 ]]; then
  batch_args=(); [[ -n "$serve_batch" ]] && batch_args=(--max-batch-size "$serve_batch")
  [[ -n "$serve_mesh" ]] && batch_args+=(--mesh "$serve_mesh")
  bind=127.0.0.1; [[ $mode == hosts && ${#host_list[@]} -gt 1 ]] && bind=0.0.0.0
  auth_args=(); [[ -n "$key_env" ]] && auth_args=(--api-key-env "$key_env")
  if [[ $bind != 127.0.0.1 && -z "$key_env" ]]; then
    [[ $open_service -eq 1 ]] || die "--api-key-env: required when the services listen beyond loopback (several hosts); or --allow-unauthenticated"
    auth_args=(--allow-unauthenticated)
  fi
  for ((k = 0; k < serve_gpus / serve_ways; k++)); do
    port=$((serve_port + k))
    first=$((gpus_per_host - serve_gpus + k * serve_ways))
    if [[ $mode == local ]]; then
      dev_env=(JAX_PLATFORMS=cpu)
      [[ $serve_ways -gt 1 ]] && dev_env+=("XLA_FLAGS=--xla_force_host_platform_device_count=$serve_ways")
    else
      dev_env=("CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + serve_ways - 1)))")
    fi
    cmd=("$py" -m drgrpo_jax.serve --config "$config" "${model_args[@]}" --host "$bind" --port "$port" "${batch_args[@]}"
         "${root_args[@]}" "${auth_args[@]}")
    if is_local "$first_host"; then
      show env "${dev_env[@]}" "${cmd[@]}" ">" "$log_dir/serve_$k.log" "2>&1" "&"
      [[ $dry_run -eq 1 ]] || { env "${dev_env[@]}" "${cmd[@]}" > "$log_dir/serve_$k.log" 2>&1 & serve_pids+=($!); }
    else
      remote="cd $(q "$workdir") && ${key_read}nohup $(show env "${dev_env[@]}" "${cmd[@]}") > serve_$k.log 2>&1 & echo \$! >> drgrpo_serve.pids"
      keyed ssh "$first_host" "$remote"
    fi
    host_for_url="$first_host"; [[ "$host_for_url" == localhost ]] && host_for_url=127.0.0.1
    serve_urls+=("http://$host_for_url:$port")
  done
fi
stop_services() {
  for pid in "${serve_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [[ $serve_gpus -gt 0 && $dry_run -eq 0 ]] && ! is_local "$first_host"; then
    ssh "$first_host" "cd $(q "$workdir") && kill \$(cat drgrpo_serve.pids) 2>/dev/null; rm -f drgrpo_serve.pids" || true
  fi
}
trap stop_services EXIT

url_args=()
[[ -n "$key_env" ]] && overrides+=("rollout.api_key_env=$key_env")
if [[ ${#serve_urls[@]} -gt 0 ]]; then
  list=$(IFS=,; echo "${serve_urls[*]}")
  url_args=("rollout.urls=[$list]")
  # Waits up to 15 minutes for every service's /health (model loading and compilation take a while).
  wait_cmd=(bash -c 'for u in "$@"; do for t in $(seq 450); do curl -sf "$u/health" > /dev/null && continue 2; sleep 2; done; echo "$u/health: no answer in 900 s" >&2; exit 1; done' wait "${serve_urls[@]}")
  if [[ ${#serve_pids[@]} -gt 0 ]]; then  # services started here: stop waiting when one of them dies
    show "${wait_cmd[@]}"
    "${wait_cmd[@]}" & waiter=$!
    while kill -0 "$waiter" 2>/dev/null; do
      for k in "${!serve_pids[@]}"; do
        if ! kill -0 "${serve_pids[$k]}" 2>/dev/null; then
          kill "$waiter" 2>/dev/null || true
          die "generation service $k exited before answering /health: $(tail -n 1 "$log_dir/serve_$k.log")"
        fi
      done
      sleep 1
    done
    wait "$waiter" || die "the generation services did not answer /health"
  elif is_local "$first_host" || [[ $mode == slurm ]]; then run "${wait_cmd[@]}"
  else run ssh "$first_host" "$(show "${wait_cmd[@]}")"; fi
fi

# 2. The trainer: one process per host.
train=("$py" -m drgrpo_jax.train --config "$config")
if [[ $mode == slurm ]]; then
  # srun starts one task per node; each computes its id and the coordinator (the first node) itself.
  inner='head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); exec "$@" mesh.coordinator_address=$head:'"$coord_port"' mesh.num_processes=$SLURM_NTASKS mesh.process_id=$SLURM_PROCID'
  run srun --ntasks-per-node=1 --kill-on-bad-exit=1 --output="$log_dir/train_%t.log" \
    env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 bash -c "$inner" drgrpo "${train[@]}" "${url_args[@]}" "${overrides[@]}"
  exit 0
fi
count=${#host_list[@]}
dist=()
for ((i = 0; i < count; i++)); do
  host="${host_list[$i]}"
  [[ $count -gt 1 ]] && dist=(mesh.coordinator_address="${first_host/localhost/127.0.0.1}:$coord_port"
                              mesh.num_processes="$count" mesh.process_id="$i")
  if [[ $mode == local ]]; then
    env_args=(JAX_PLATFORMS=cpu JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo
              XLA_FLAGS=--xla_force_host_platform_device_count=$local_devices)
  else
    env_args=(XLA_PYTHON_CLIENT_MEM_FRACTION=0.9)
    if [[ $i -eq 0 && $serve_gpus -gt 0 ]]; then
      env_args+=(CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus_per_host - serve_gpus - 1))))
    fi
  fi
  if ! is_local "$host"; then
    remote="cd $(q "$workdir") && ${key_read}$(show env "${env_args[@]}" "${train[@]}" "${dist[@]}" "${url_args[@]}" "${overrides[@]}")"
    if [[ -n "$key_env" ]]; then
      echo "$(show ssh "$host" "$remote") <<< \"\$$key_env\" > $(q "$log_dir/train_$i.log") 2>&1 &"
      [[ $dry_run -eq 1 ]] || { ssh "$host" "$remote" <<< "${!key_env}" > "$log_dir/train_$i.log" 2>&1 & pids+=($!); }
    else
      show ssh "$host" "$remote" ">" "$log_dir/train_$i.log" "2>&1" "&"
      [[ $dry_run -eq 1 ]] || { ssh "$host" "$remote" > "$log_dir/train_$i.log" 2>&1 & pids+=($!); }
    fi
  else
    show env "${env_args[@]}" "${train[@]}" "${dist[@]}" "${url_args[@]}" "${overrides[@]}" ">" "$log_dir/train_$i.log" "2>&1" "&"
    if [[ $dry_run -eq 0 ]]; then
      env "${env_args[@]}" "${train[@]}" "${dist[@]}" "${url_args[@]}" "${overrides[@]}" > "$log_dir/train_$i.log" 2>&1 &
      pids+=($!)
    fi
  fi
done
[[ $dry_run -eq 1 ]] && exit 0
# 3. All processes fail together: the first non-zero exit stops the rest.
status=0
for ((done_count = 0; done_count < count; done_count++)); do
  if ! wait -n "${pids[@]}"; then
    status=1
    echo "launch_gpu.sh: a trainer process failed; stopping the others (logs in $log_dir)" >&2
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    break
  fi
done
for ((i = 0; i < count; i++)); do tail -n 3 "$log_dir/train_$i.log" | sed "s/^/[process $i] /"; done
exit $status
