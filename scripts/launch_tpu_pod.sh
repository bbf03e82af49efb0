#!/usr/bin/env bash
# Runs `python -m drgrpo_jax.train --config ... mesh.coordinator_address=auto` on every worker of a Cloud TPU VM
# slice: one `gcloud compute tpus tpu-vm ssh --worker=all` command, the same on every worker (JAX detects the
# pod: the coordinator, the process count and each worker's id), started detached so that closing this terminal
# leaves the run going. Places the generation services.
#
#   scripts/launch_tpu_pod.sh --tpu NAME --zone ZONE --config PATH [options] [-- section.key=value ...]
#   scripts/launch_tpu_pod.sh --tpu NAME --zone ZONE --stop [--serve-tpu NAME]
#
# A launch ships this working tree AS IT IS (tracked and untracked files that git does not ignore, uncommitted
# edits included) and the config into each worker's run folder ~/drgrpo_run (src/, run.yaml), stops what an earlier
# launch left there (as --stop does), installs, starts the services, waits for their /health, then starts the
# trainer detached: its log is ~/drgrpo_run/trainer.log and its process group ~/drgrpo_run/trainer.pid on each
# worker. A trainer that exits 42 (preempted: it saved a checkpoint) is started again, up to --max-restarts times.
# --stop, on every worker of --tpu and --serve-tpu: SIGTERM to the trainer's and services' process groups (by pid
# file) and to any other trainer or service started from the run folder (the trainer saves and exits), SIGKILL
# after --stop-grace seconds, then removes the pid files and the libtpu lockfile (/tmp/libtpu_lockfile).
#
#   --project P            gcloud project (default: gcloud's)
#   --jax-version V        jax[tpu]==V on the workers (default: the jax installed here); skipped where a worker
#                          already has jax V with libtpu
#   --install CMD          the install command run in each worker's run folder instead (default below)
#   --max-restarts N       restarts after exit 42 (default 3); --stop-grace S (default 120)
#   --retries N            tries again a failed gcloud scp/ssh step up to N times (default 3), waiting
#                          --retry-delay S seconds (default 10), doubled after each try
#   --health-timeout S     how long the trainer waits for the services' /health (default 900)
#   Generation services (python -m drgrpo_jax.serve, one chip each unless --serve-mesh). Every worker's trainer
#   samples and scores its share of each step's prompts from all of them (worker i starts at URL i mod n), so a
#   multi-worker slice needs them; only a one-worker trainer without any starts its own child service. Started
#   services run until --stop:
#   --serve-tpu NAME       on a separate slice, --serve-chips per worker of it (IPs: --serve-ips ip,ip or describe)
#   --serve-chips K        service chips per service worker; without --serve-tpu: on the last K of --chips-per-worker
#                          (default 4; 8 on a v5e-8 / v6e-8 host) of a ONE-worker slice (--num-workers N: the slice's
#                          workers, default describe), the trainer keeping the others (TPU_VISIBLE_CHIPS)
#   --serve-mesh SPEC      each started service spans several chips: tensor=T[,data=D] (drgrpo_jax.serve --mesh),
#                          T x D chips per service, so --serve-chips counts chips and must be a multiple of T x D
#   --serve-url URL        running services instead (repeatable): drgrpo_jax.serve (SGLang-JAX, vLLM-TPU unverified)
#   --serve-batch-size B   --max-batch-size of started services (see python -m drgrpo_jax.plan)
#   --serve-port P         first service port (default 30000)
#   --api-key-env NAME     the services' API key is in $NAME here: it is copied to every worker in a mode-600
#                          file (~/drgrpo_run/api_key.env) that services (--api-key-env NAME) and trainers
#                          (rollout.api_key_env=NAME) source; commands show the name, never the value. Services on
#                          a separate slice listen beyond loopback, so they need it (or --allow-unauthenticated)
#   --allow-unauthenticated  services on a separate slice without a key (a network you trust)
#   --dry-run              print every command instead of running it
# model.path, data.path and run.output_dir must be paths every worker (and the service slice) sees: a shared
# disk, Filestore/NFS or a gcsfuse mount; weights are pushed through run.output_dir/weights (process 0 writes each
# version and tells every service to load it; no worker samples before every service has it).
set -euo pipefail

tpu="" zone="" project="" config="" workers="" chips=4 serve_tpu="" serve_ips="" serve_chips=0 serve_mesh=""
serve_batch="" serve_port=30000 dry_run=0 key_env="" open_service=0 stop=0 jax_version="" install=""
max_restarts=3 stop_grace=120 retries=3 retry_delay=10 health_timeout=900
serve_urls=() overrides=()
die() { echo "launch_tpu_pod.sh: $*" >&2; exit 2; }
fail() { echo "launch_tpu_pod.sh: $*" >&2; exit 1; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu) tpu="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --num-workers) workers="$2"; shift 2 ;;
    --chips-per-worker) chips="$2"; shift 2 ;;
    --serve-tpu) serve_tpu="$2"; shift 2 ;;
    --serve-ips) serve_ips="$2"; shift 2 ;;
    --serve-chips) serve_chips="$2"; shift 2 ;;
    --serve-mesh) serve_mesh="$2"; shift 2 ;;
    --serve-url) serve_urls+=("$2"); shift 2 ;;
    --serve-batch-size) serve_batch="$2"; shift 2 ;;
    --serve-port) serve_port="$2"; shift 2 ;;
    --jax-version) jax_version="$2"; shift 2 ;;
    --install) install="$2"; shift 2 ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --stop-grace) stop_grace="$2"; shift 2 ;;
    --retries) retries="$2"; shift 2 ;;
    --retry-delay) retry_delay="$2"; shift 2 ;;
    --health-timeout) health_timeout="$2"; shift 2 ;;
    --api-key-env) key_env="$2"; shift 2 ;;
    --allow-unauthenticated) open_service=1; shift ;;
    --stop) stop=1; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; overrides=("$@"); break ;;
    *) die "unknown option $1 (see the header of scripts/launch_tpu_pod.sh)" ;;
  esac
done
[[ -n "$tpu" ]] || die "--tpu: required (the TPU VM slice name)"
[[ -n "$zone" ]] || die "--zone: required"
for n in chips serve_chips serve_port max_restarts stop_grace retries retry_delay health_timeout; do
  [[ "${!n}" =~ ^[0-9]+$ ]] || die "--${n//_/-}: must be a non-negative integer, got '${!n}'"
done

q() { if [[ "$1" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
show() { local out="" a; for a in "$@"; do out+="$(q "$a") "; done; echo "${out% }"; }
run() { show "$@"; [[ $dry_run -eq 1 ]] || "$@"; }
retry() {  # retry CMD...: run it, and again after a doubling pause, up to --retries more times (flaky ssh, scp)
  local try=1
  show "$@"; [[ $dry_run -eq 0 ]] || return 0
  until "$@"; do
    ((try <= retries)) || fail "${*:1:6} failed $try times (--retries $retries): gcloud's message is above"
    echo "launch_tpu_pod.sh: ${*:1:6} failed (try $try of $((retries + 1))); again in $((retry_delay << (try - 1))) s" >&2
    sleep $((retry_delay << (try - 1))); try=$((try + 1))
  done
}
scope=(--zone="$zone"); [[ -n "$project" ]] && scope+=(--project="$project")
ssh_all() { retry gcloud compute tpus tpu-vm ssh "$1" --worker=all "${scope[@]}" --command="$2"; }

# On a worker, in its run folder: the trainer's and services' process groups and any other trainer or service
# started from this folder (a lost pid file) get SIGTERM (the trainer saves), SIGKILL after --stop-grace.
# The [.] keeps the pattern from matching the shell that runs this very command.
stop_here="s=\"drgrpo_jax[.](train|serve) --config \$PWD/run[.]yaml\"; g=\$(cat trainer.pid serve.pids 2> /dev/null); \
sig() { for p in \$g; do kill -\$1 -- -\$p; done 2> /dev/null; pkill -\$1 -f \"\$s\"; }; \
up() { for p in \$g; do kill -0 -- -\$p 2> /dev/null && return; done; pgrep -f \"\$s\" > /dev/null; }; \
sig TERM; for t in \$(seq $stop_grace); do up || break; sleep 1; done; sig KILL; \
rm -f trainer.pid serve.pids /tmp/libtpu_lockfile"
in_run_dir="mkdir -p ~/drgrpo_run && cd ~/drgrpo_run && { $stop_here; }"

slices=("$tpu"); [[ -n "$serve_tpu" ]] && slices+=("$serve_tpu")
if [[ $stop -eq 1 ]]; then
  for slice in "${slices[@]}"; do ssh_all "$slice" "$in_run_dir"; done
  exit 0
fi

[[ -n "$config" ]] || die "--config: required"
[[ -f "$config" ]] || die "--config: no such file $config"
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
if [[ -z "$install" ]]; then
  if [[ -z "$jax_version" ]]; then
    jax_version="$(python3 -c 'import importlib.metadata as m; print(m.version("jax"))' 2> /dev/null)" || \
      die "--jax-version: required (no jax installed here to pin the workers' jax[tpu] to)"
  fi
  [[ "$jax_version" =~ ^[0-9][0-9A-Za-z.+-]*$ ]] || die "--jax-version: not a version, got '$jax_version'"
  install="{ python3 -c \"import jax, libtpu; assert jax.__version__ == '$jax_version'\" 2> /dev/null || \
python3 -m pip install -q 'jax[tpu]==$jax_version'; } && python3 -m pip install -q -e 'src[train]'"
fi

ips_of() {  # internal IPs of a slice's workers, comma-separated, worker 0 first
  gcloud compute tpus tpu-vm describe "$1" "${scope[@]}" --format='value(networkEndpoints[].ipAddress)' | tr ';' ','
}
train_chips=$chips
if [[ -z "$serve_tpu" && $serve_chips -gt 0 ]]; then
  if [[ -z "$workers" ]]; then
    [[ $dry_run -eq 0 ]] || die "--num-workers: required with --serve-chips and --dry-run (or omit --dry-run)"
    IFS=, read -r -a train_ips <<< "$(ips_of "$tpu")"; workers=${#train_ips[@]}
  fi
  [[ "$workers" == 1 ]] || die "--serve-chips: without --serve-tpu only on a one-worker slice (all chips of a pod train)"
  train_chips=$((chips - serve_chips))
  case $train_chips in 1) bounds=1,1,1 ;; 2) bounds=1,2,1 ;; 4) bounds=2,2,1 ;;
    *) die "--serve-chips: leaves $train_chips trainer chips; 1, 2 or 4 can form a process's chip bounds" ;; esac
fi
if [[ -n "$serve_tpu" && -z "$serve_ips" ]]; then
  [[ $dry_run -eq 0 ]] || die "--serve-ips: required with --serve-tpu and --dry-run"
  serve_ips="$(ips_of "$serve_tpu")"
fi

# 1. The working tree as it is (deleted files left out), the config and the key file, staged here.
stage=/tmp/drgrpo_launch.XXXXXX  # shown in dry runs; the real one is a fresh mode-700 folder
[[ $dry_run -eq 1 ]] || stage="$(mktemp -d /tmp/drgrpo_launch.XXXXXX)"
trap '[[ $dry_run -eq 1 ]] || rm -rf "$stage"' EXIT
root="$(q "$(cd "$(dirname "$0")/.." && pwd)")"
pack="git -C $root ls-files -z -co --exclude-standard | grep -zvxFf <(git -C $root ls-files -d) | \
tar -C $root --null -T - -czf $stage/drgrpo_src.tar.gz"
echo "$pack"; [[ $dry_run -eq 1 ]] || eval "$pack" || fail "packing the working tree $root failed"
run cp "$config" "$stage/drgrpo_run.yaml"
shipped=("$stage/drgrpo_src.tar.gz" "$stage/drgrpo_run.yaml") unpack_key="" key_in_shell="" key_arg="" key_override=""
if [[ -n "$key_env" ]]; then
  shipped+=("$stage/drgrpo_api_key.env")
  [[ $dry_run -eq 1 ]] || (umask 077; printf '%s=%q\n' "$key_env" "${!key_env}" > "$stage/drgrpo_api_key.env")
  unpack_key=" && mv ~/drgrpo_api_key.env api_key.env && chmod 600 api_key.env"
  key_in_shell="set -a && . ./api_key.env && set +a && "
  key_arg=" --api-key-env $key_env" key_override=" rollout.api_key_env=$key_env"
elif [[ -n "$serve_tpu" ]]; then
  key_arg=" --allow-unauthenticated"
fi
prepare="$in_run_dir && rm -rf src && mkdir src && tar -xzf ~/drgrpo_src.tar.gz -C src && rm ~/drgrpo_src.tar.gz && \
mv ~/drgrpo_run.yaml run.yaml$unpack_key && $install"

# 2. Generation services, --serve-mesh's chips each (TPU_VISIBLE_CHIPS), detached, pids in serve.pids.
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
start_services() {  # start_services FIRST_CHIP BIND: the remote command starting each worker's services
  local k cmd="" auth="$key_arg"
  [[ "$2" == 127.0.0.1 && -z "$key_env" ]] && auth=""
  for ((k = 0; k < services; k++)); do
    cmd+="TPU_VISIBLE_CHIPS=$(seq -s, $(($1 + k * serve_ways)) $(($1 + (k + 1) * serve_ways - 1))) "
    cmd+="TPU_CHIPS_PER_PROCESS_BOUNDS=$serve_bounds TPU_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_PORT=$((8477 + k)) "
    cmd+="setsid nohup python3 -m drgrpo_jax.serve --config \$PWD/run.yaml$model_args --host $2 "
    cmd+="--port $((serve_port + k))$batch_args$root_args$auth > serve_$k.log 2>&1 < /dev/null & echo \$! >> serve.pids; "
  done
  echo " && $key_in_shell{ ${cmd% } }"
}
serve_on=""
if [[ -n "$serve_tpu" ]]; then
  IFS=, read -r -a ips <<< "$serve_ips"
  for ip in "${ips[@]}"; do
    for ((k = 0; k < services; k++)); do serve_urls+=("http://$ip:$((serve_port + k))"); done
  done
  serve_on="$serve_tpu"
  retry gcloud compute tpus tpu-vm scp "${shipped[@]}" "$serve_tpu:" --worker=all "${scope[@]}"
  ssh_all "$serve_tpu" "$prepare$(start_services 0 0.0.0.0)"
fi
retry gcloud compute tpus tpu-vm scp "${shipped[@]}" "$tpu:" --worker=all "${scope[@]}"
if [[ -z "$serve_tpu" && $serve_chips -gt 0 ]]; then  # the trainer is on this host: loopback is enough
  for ((k = 0; k < services; k++)); do serve_urls+=("http://127.0.0.1:$((serve_port + k))"); done
  serve_on="$tpu"
  ssh_all "$tpu" "$prepare$(start_services "$train_chips" 127.0.0.1)"
else
  ssh_all "$tpu" "$prepare"
fi

# 3. Every worker waits for every service's /health, up to --health-timeout seconds (not retried: a timeout).
url_args=""
if [[ ${#serve_urls[@]} -gt 0 ]]; then
  url_args=" $(q "rollout.urls=[$(IFS=,; echo "${serve_urls[*]}")]")"
  wait_health="end=\$((\$(date +%s) + $health_timeout)); for u in ${serve_urls[*]}; do until curl -sf --max-time 10 \
\$u/health > /dev/null; do [ \$(date +%s) -ge \$end ] && exit 3; sleep 2; done; done"
  if ! run gcloud compute tpus tpu-vm ssh "$tpu" --worker=all "${scope[@]}" --command="$wait_health"; then
    [[ -z "$serve_on" ]] || (ssh_all "$serve_on" "$in_run_dir") > /dev/null 2>&1 || true
    fail "no answer from ${serve_urls[*]} /health on a worker of $tpu within $health_timeout s (--health-timeout)\
$([[ -z "$serve_on" ]] || echo "; stopped the services, their logs: ~/drgrpo_run/serve_*.log on $serve_on")"
  fi
fi

# 4. The trainer, detached in its own process group (trainer.pid), the same command on every worker; a retried
# start leaves a running trainer be.
dist=" mesh.coordinator_address=auto" chip_env=""
if [[ $train_chips -lt $chips ]]; then  # one worker, one process: no jax.distributed
  dist="" chip_env="TPU_VISIBLE_CHIPS=$(seq -s, 0 $((train_chips - 1))) TPU_CHIPS_PER_PROCESS_BOUNDS=$bounds \
TPU_PROCESS_BOUNDS=1,1,1 "
fi
extra=""; [[ ${#overrides[@]} -gt 0 ]] && extra=" $(show "${overrides[@]}")"
load_key=""; [[ -n "$key_env" ]] && load_key="set -a; . ./api_key.env; set +a; "
restarts="${load_key}n=0; while :; do \"\$@\"; c=\$?; [ \$c -eq 42 ] && [ \$n -lt $max_restarts ] || exit \$c; \
n=\$((n + 1)); echo \"launch_tpu_pod.sh: the trainer saved and exited 42 (preempted): restart \$n of $max_restarts\" >&2; done"
start="cd ~/drgrpo_run && if [ -f trainer.pid ] && kill -0 -- -\$(cat trainer.pid) 2> /dev/null; then \
echo \"trainer already running: \$(cat trainer.pid)\"; else ${chip_env}setsid nohup bash -c '$restarts' trainer \
python3 -m drgrpo_jax.train --config \$PWD/run.yaml$dist$url_args$key_override$extra > trainer.log 2>&1 < /dev/null \
& echo \$! > trainer.pid; fi"
ssh_all "$tpu" "$start"
[[ $dry_run -eq 1 ]] || cat << EOF
Started on every worker of $tpu; each worker's log: ~/drgrpo_run/trainer.log, e.g.
  gcloud compute tpus tpu-vm ssh $tpu --worker=0 ${scope[*]} --command='tail -f drgrpo_run/trainer.log'
Stop (services too): $0 --tpu $tpu --zone $zone$([[ -z "$project" ]] || echo " --project $project")$(
  [[ -z "$serve_tpu" ]] || echo " --serve-tpu $serve_tpu") --stop
EOF
