#!/usr/bin/env bash
# Runs the same `python -m drgrpo_jax.train --config ...` on every worker of a Cloud TPU VM slice, one JAX
# process per worker, after copying this checkout there and installing it; places the generation services.
#
#   scripts/launch_tpu_pod.sh --tpu NAME --zone ZONE --config PATH [options] [-- section.key=value ...]
#
#   --project P            gcloud project (default: gcloud's)
#   --num-workers N        workers (hosts) of the slice; --coordinator IP: worker 0's internal IP
#                          (both default to `gcloud compute tpus tpu-vm describe`; required with --dry-run)
#   --chips-per-worker C   TPU chips per worker (default 4; 8 on a v5e-8 / v6e-8 host)
#   Generation services (python -m drgrpo_jax.serve, one chip each unless --serve-mesh). Every worker's trainer
#   samples and scores its share of each step's prompts from all of them (worker i starts at URL i mod n), so a
#   multi-worker slice needs them; only a one-worker trainer without any starts its own child service:
#   --serve-tpu NAME       on a separate slice, --serve-chips per worker of it (IPs: --serve-ips ip,ip or describe)
#   --serve-chips K        service chips per service worker; without --serve-tpu: on the last K chips of a ONE-worker
#                          slice, the trainer keeping the others (TPU_VISIBLE_CHIPS)
#   --serve-mesh SPEC      each started service spans several chips: tensor=T[,data=D] (drgrpo_jax.serve --mesh),
#                          T x D chips per service, so --serve-chips counts chips and must be a multiple of T x D
#   --serve-url URL        running services instead (repeatable): drgrpo_jax.serve (SGLang-JAX, vLLM-TPU unverified)
#   --serve-batch-size B   --max-batch-size of started services (see python -m drgrpo_jax.plan)
#   --serve-port P         first service port (default 30000); --coordinator-port P (default 8476)
#   --install CMD          install command on every worker (default below); --log-dir DIR (default launch_logs)
#   --api-key-env NAME     the services' API key is in $NAME here: it is copied to every worker in a mode-600
#                          file (~/drgrpo_api_key.env) that services (--api-key-env NAME) and trainers
#                          (rollout.api_key_env=NAME) source; commands show the name, never the value. Services on
#                          a separate slice listen beyond loopback, so they need it (or --allow-unauthenticated)
#   --allow-unauthenticated  services on a separate slice without a key (a network you trust)
#   --dry-run              print every command instead of running it
# model.path, data.path and run.output_dir must be paths every worker (and the service slice) sees: a shared
# disk, Filestore/NFS or a gcsfuse mount; weights are pushed through run.output_dir/weights (process 0 writes each
# version and tells every service to load it; no worker samples before every service has it).
set -euo pipefail

tpu="" zone="" project="" config="" workers="" coordinator="" chips=4 serve_tpu="" serve_ips="" serve_chips=0
serve_mesh=""
serve_batch="" serve_port=30000 coord_port=8476 log_dir=launch_logs dry_run=0 key_env="" open_service=0
install="python3 -m pip install -q -e ~/drgrpo_jax'[train]' 'jax[tpu]'"  # the trainer: the train extra
serve_urls=() overrides=()
die() { echo "launch_tpu_pod.sh: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) tpu="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --num-workers) workers="$2"; shift 2 ;;
    --coordinator) coordinator="$2"; shift 2 ;;
    --chips-per-worker) chips="$2"; shift 2 ;;
    --serve-tpu) serve_tpu="$2"; shift 2 ;;
    --serve-ips) serve_ips="$2"; shift 2 ;;
    --serve-chips) serve_chips="$2"; shift 2 ;;
    --serve-mesh) serve_mesh="$2"; shift 2 ;;
    --serve-url) serve_urls+=("$2"); shift 2 ;;
    --serve-batch-size) serve_batch="$2"; shift 2 ;;
    --serve-port) serve_port="$2"; shift 2 ;;
    --coordinator-port) coord_port="$2"; shift 2 ;;
    --install) install="$2"; shift 2 ;;
    --log-dir) log_dir="$2"; shift 2 ;;
    --api-key-env) key_env="$2"; shift 2 ;;
    --allow-unauthenticated) open_service=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; overrides=("$@"); break ;;
    *) die "unknown option $1 (see the header of scripts/launch_tpu_pod.sh)" ;;
  esac
done
[[ -n "$tpu" ]] || die "--tpu: required (the TPU VM slice name)"
[[ -n "$zone" ]] || die "--zone: required"
[[ -n "$config" ]] || die "--config: required"
[[ -f "$config" ]] || die "--config: no such file $config"
for n in chips serve_chips serve_port coord_port; do
  [[ "${!n}" =~ ^[0-9]+$ ]] || die "--${n//_/-}: must be a non-negative integer, got '${!n}'"
done
[[ -z "$serve_tpu" || $serve_chips -ge 1 ]] || die "--serve-chips: needs at least 1 with --serve-tpu"
# Chips per service: the product of --serve-mesh's sizes (drgrpo_jax.serve checks the rest of it).
serve_ways=1
if [[ -n "$serve_mesh" ]]; then
  [[ "$serve_mesh" =~ ^(tensor|data)=[1-9][0-9]*(,(tensor|data)=[1-9][0-9]*)?$ ]] || \
    die "--serve-mesh: must be tensor=T[,data=D], got '$serve_mesh'"
  for part in ${serve_mesh//,/ }; do serve_ways=$((serve_ways * ${part#*=})); done
  [[ $serve_chips -ge 1 ]] || die "--serve-mesh: needs --serve-chips (the chips its services span)"
fi
(( serve_chips % serve_ways == 0 )) || \
  die "--serve-chips: $serve_chips chips do not split into services of $serve_ways (--serve-mesh $serve_mesh)"
case $serve_ways in 1) serve_bounds=1,1,1 ;; 2) serve_bounds=1,2,1 ;; 4) serve_bounds=2,2,1 ;; 8) serve_bounds=2,4,1 ;;
  *) die "--serve-mesh: $serve_ways chips per service; 1, 2, 4 or 8 can form a process's chip bounds" ;; esac
services=$((serve_chips / serve_ways))
[[ ${#serve_urls[@]} -eq 0 || ( -z "$serve_tpu" && $serve_chips -eq 0 ) ]] || \
  die "--serve-url: not together with --serve-tpu/--serve-chips"
if [[ -n "$key_env" ]]; then
  [[ "$key_env" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--api-key-env: '$key_env' is not an environment variable name"
  [[ -n "${!key_env:-}" ]] || die "--api-key-env: environment variable $key_env is not set or empty"
elif [[ -n "$serve_tpu" && $open_service -eq 0 ]]; then
  die "--api-key-env: required for services on --serve-tpu (they listen beyond loopback); or --allow-unauthenticated"
fi

q() { if [[ "$1" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
show() { local out="" a; for a in "$@"; do out+="$(q "$a") "; done; echo "${out% }"; }
run() { show "$@"; [[ $dry_run -eq 1 ]] || "$@"; }
scope=(--zone="$zone"); [[ -n "$project" ]] && scope+=(--project="$project")

ips_of() {  # internal IPs of a slice's workers, comma-separated, worker 0 first
  gcloud compute tpus tpu-vm describe "$1" "${scope[@]}" --format='value(networkEndpoints[].ipAddress)' | tr ';' ','
}
if [[ -z "$workers" || ( -z "$coordinator" && "$workers" != 1 ) ]]; then
  [[ $dry_run -eq 0 ]] || die "--num-workers and --coordinator: required with --dry-run (or omit --dry-run)"
  IFS=, read -r -a train_ips <<< "$(ips_of "$tpu")"
  workers="${workers:-${#train_ips[@]}}"; coordinator="${coordinator:-${train_ips[0]}}"
fi
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || die "--num-workers: must be a positive integer, got '$workers'"
train_chips=$chips
if [[ -z "$serve_tpu" && $serve_chips -gt 0 ]]; then
  [[ "$workers" == 1 ]] || die "--serve-chips: without --serve-tpu only on a one-worker slice (all chips of a pod train)"
  train_chips=$((chips - serve_chips))
  case $train_chips in 1) bounds=1,1,1 ;; 2) bounds=1,2,1 ;; 4) bounds=2,2,1 ;;
    *) die "--serve-chips: leaves $train_chips trainer chips; 1, 2 or 4 can form a process's chip bounds" ;; esac
fi
if [[ -n "$serve_tpu" && -z "$serve_ips" ]]; then
  [[ $dry_run -eq 0 ]] || die "--serve-ips: required with --serve-tpu and --dry-run"
  serve_ips="$(ips_of "$serve_tpu")"
fi

# 1. This checkout, the config (and the key file) onto every worker, then install.
archive=/tmp/drgrpo_jax-src.tar.gz
run git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$archive" HEAD
key_files=() key_src="" chmod_key=""
cleanup_key() { [[ -z "$key_src" || $dry_run -eq 1 ]] || rm -rf "$(dirname "$key_src")"; }
if [[ -n "$key_env" ]]; then
  key_src=/tmp/drgrpo_key.XXXXXX/drgrpo_api_key.env  # shown in dry runs; the real one is a fresh mode-700 folder
  if [[ $dry_run -eq 0 ]]; then
    key_src="$(mktemp -d /tmp/drgrpo_key.XXXXXX)/drgrpo_api_key.env"
    (umask 077; printf '%s=%q\n' "$key_env" "${!key_env}" > "$key_src")
  fi
  key_files=("$key_src") chmod_key=" && chmod 600 ~/drgrpo_api_key.env"
fi
trap cleanup_key EXIT
slices=("$tpu"); [[ -n "$serve_tpu" ]] && slices+=("$serve_tpu")
for slice in "${slices[@]}"; do
  run gcloud compute tpus tpu-vm scp "$archive" "$config" "${key_files[@]}" "$slice:" --worker=all "${scope[@]}"
  run gcloud compute tpus tpu-vm ssh "$slice" --worker=all "${scope[@]}" --command="rm -rf ~/drgrpo_jax && mkdir -p \
~/drgrpo_jax && tar -xzf ~/$(basename "$archive") -C ~/drgrpo_jax && cp ~/$(basename "$config") ~/drgrpo_run.yaml$chmod_key && $install"
done
key_load="" key_arg="" key_override=""
if [[ -n "$key_env" ]]; then
  key_load="set -a && . ~/drgrpo_api_key.env && set +a && "
  key_arg=" --api-key-env $key_env" key_override=" rollout.api_key_env=$key_env"
elif [[ -n "$serve_tpu" ]]; then
  key_arg=" --allow-unauthenticated"
fi

# 2. Generation services, --serve-mesh's chips each (TPU_VISIBLE_CHIPS), their URLs passed to the trainer.
model_args="" out_root="" mirror_root="" root_args=""
for o in "${overrides[@]}"; do
  [[ "$o" == model.path=* ]] && model_args=" --model $(q "${o#model.path=}")"
  [[ "$o" == run.output_dir=* ]] && out_root="${o#run.output_dir=}/weights"
  [[ "$o" == run.weights_dir=* ]] && mirror_root="${o#run.weights_dir=}"
done
# Weight pushes load only from the run's weights folder (drgrpo_jax.serve derives it from the config otherwise).
[[ -n "$mirror_root$out_root" ]] && root_args=" --weights-root $(q "${mirror_root:-$out_root}")"
batch_args=""; [[ -n "$serve_batch" ]] && batch_args=" --max-batch-size $serve_batch"
[[ -n "$serve_mesh" ]] && batch_args+=" --mesh $serve_mesh"
start_services() {  # start_services SLICE WORKER FIRST_CHIP BIND: the remote command starting the services
  local k cmd="$key_load" auth="$key_arg"
  [[ "$4" == 127.0.0.1 && -z "$key_env" ]] && auth=""
  for ((k = 0; k < services; k++)); do
    cmd+="TPU_VISIBLE_CHIPS=$(seq -s, $(($3 + k * serve_ways)) $(($3 + (k + 1) * serve_ways - 1))) "
    cmd+="TPU_CHIPS_PER_PROCESS_BOUNDS=$serve_bounds TPU_PROCESS_BOUNDS=1,1,1 "
    cmd+="TPU_PROCESS_PORT=$((coord_port + 1 + k)) nohup python3 -m drgrpo_jax.serve --config drgrpo_run.yaml"
    cmd+="$model_args --host $4 --port $((serve_port + k))$batch_args$root_args$auth > serve_$k.log 2>&1 & "
    cmd+="echo \$! >> drgrpo_serve.pids; "
  done
  run gcloud compute tpus tpu-vm ssh "$1" --worker="$2" "${scope[@]}" --command="${cmd%; }"
}
stop_slices=()
if [[ -n "$serve_tpu" ]]; then
  IFS=, read -r -a ips <<< "$serve_ips"
  for w in "${!ips[@]}"; do
    start_services "$serve_tpu" "$w" 0 0.0.0.0
    for ((k = 0; k < services; k++)); do serve_urls+=("http://${ips[$w]}:$((serve_port + k))"); done
  done
  stop_slices+=("$serve_tpu")
elif [[ $serve_chips -gt 0 ]]; then
  start_services "$tpu" 0 "$train_chips" 127.0.0.1  # the trainer is on this host: loopback is enough
  for ((k = 0; k < services; k++)); do serve_urls+=("http://127.0.0.1:$((serve_port + k))"); done
  stop_slices+=("$tpu")
fi
stop_services() {
  cleanup_key
  for slice in "${stop_slices[@]}"; do
    run gcloud compute tpus tpu-vm ssh "$slice" --worker=all "${scope[@]}" \
      --command='kill $(cat drgrpo_serve.pids) 2>/dev/null; rm -f drgrpo_serve.pids' || true
  done
}
[[ ${#stop_slices[@]} -eq 0 ]] || trap stop_services EXIT

# 3. The trainer on every worker, each with its process id; logs stream back into --log-dir.
wait_urls="" url_args=""
if [[ ${#serve_urls[@]} -gt 0 ]]; then
  wait_urls="for u in ${serve_urls[*]}; do until curl -sf \$u/health > /dev/null; do sleep 5; done; done && "
  url_args=" $(q "rollout.urls=[$(IFS=,; echo "${serve_urls[*]}")]")"
fi
chip_env=""
[[ $train_chips -lt $chips ]] && chip_env="TPU_VISIBLE_CHIPS=$(seq -s, 0 $((train_chips - 1))) \
TPU_CHIPS_PER_PROCESS_BOUNDS=$bounds TPU_PROCESS_BOUNDS=1,1,1 "
extra=""; [[ ${#overrides[@]} -gt 0 ]] && extra=" $(show "${overrides[@]}")"
[[ $dry_run -eq 1 ]] || mkdir -p "$log_dir"
pids=()
for ((i = 0; i < workers; i++)); do
  dist=""; [[ "$workers" -gt 1 ]] && dist=" mesh.coordinator_address=$coordinator:$coord_port \
mesh.num_processes=$workers mesh.process_id=$i"
  cmd="${key_load}${wait_urls}${chip_env}python3 -m drgrpo_jax.train --config drgrpo_run.yaml$dist$url_args$key_override$extra"
  line=(gcloud compute tpus tpu-vm ssh "$tpu" --worker="$i" "${scope[@]}" --command="$cmd")
  echo "$(show "${line[@]}") > $log_dir/train_$i.log 2>&1 &"
  if [[ $dry_run -eq 0 ]]; then "${line[@]}" > "$log_dir/train_$i.log" 2>&1 & pids+=($!); fi
done
[[ $dry_run -eq 1 ]] && exit 0
status=0
for ((n = 0; n < workers; n++)); do
  if ! wait -n "${pids[@]}"; then
    status=1
    echo "launch_tpu_pod.sh: a worker failed; stopping the others (logs in $log_dir)" >&2
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    break
  fi
done
for ((i = 0; i < workers; i++)); do tail -n 3 "$log_dir/train_$i.log" | sed "s/^/[worker $i] /"; done
exit $status
