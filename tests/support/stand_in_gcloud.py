"""A stand-in for `gcloud compute tpus tpu-vm` (ssh, scp, describe): every worker of a slice is a folder here.

Run as a script (`gcloud` on PATH execs it). Slice NAME's workers are the folders $FAKE_TPU_ROOT/NAME/worker<i>, i <
$FAKE_TPU_WORKERS (default 2), each the HOME of its worker, with its own tmp/ standing in for the machine's /tmp:
- `ssh NAME --worker=all --command=C` runs C with bash in every worker folder at once, with TPU_WORKER_ID=i and
  $FAKE_WORKER_BIN first on PATH, as gcloud's ssh to each worker would; exit: the first failing worker's code;
- `scp SRC... NAME:[DEST] --worker=all` copies into every worker folder;
- `describe NAME ... --format=value(networkEndpoints[].ipAddress)` prints the workers' IPs (10.0.0.<2+i>).
FAKE_GCLOUD_FAIL=ssh fails every ssh as an unreachable host does (255); =scp-once fails the first scp only.
Each call's verb is appended to $FAKE_TPU_ROOT/calls, and its argv (a JSON list) to $FAKE_TPU_ROOT/argv.jsonl.
"""

import json
import os
import shutil
import subprocess
import sys


def _workers(root: str, name: str) -> list[str]:
    homes = [os.path.join(root, name, f"worker{i}") for i in range(int(os.environ.get("FAKE_TPU_WORKERS", "2")))]
    for home in homes:
        os.makedirs(os.path.join(home, "tmp"), exist_ok=True)
    return homes


def _option(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(name + "=")), None)


def _fails(root: str, verb: str) -> bool:
    mode = os.environ.get("FAKE_GCLOUD_FAIL", "")
    with open(os.path.join(root, "calls")) as f:
        first = f.read().split().count(verb) == 1
    return mode == verb or (mode == "scp-once" and verb == "scp" and first)


def _ssh(root: str, name: str, command: str) -> int:
    runs = []
    for i, home in enumerate(_workers(root, name)):
        # Each worker is its own machine: its /tmp is the folder's tmp/ (the libtpu lockfile lives there).
        env = {**os.environ, "HOME": home, "TPU_WORKER_ID": str(i),
               "PATH": os.environ["FAKE_WORKER_BIN"] + os.pathsep + os.environ["PATH"]}
        runs.append(subprocess.Popen(["bash", "-c", command.replace("/tmp/", f"{home}/tmp/")], cwd=home, env=env))
    codes = [run.wait() for run in runs]
    return next((code for code in codes if code), 0)


def main(argv: list[str]) -> int:
    root = os.environ["FAKE_TPU_ROOT"]
    assert argv[:3] == ["compute", "tpus", "tpu-vm"], argv
    verb, rest = argv[3], argv[4:]
    with open(os.path.join(root, "calls"), "a") as f:
        f.write(verb + "\n")
    with open(os.path.join(root, "argv.jsonl"), "a") as f:
        f.write(json.dumps(argv) + "\n")
    if verb == "describe":
        print(";".join(f"10.0.0.{2 + i}" for i in range(len(_workers(root, rest[0])))))
        return 0
    assert _option(rest, "--worker") == "all", f"only --worker=all is stood in: {argv}"
    if _fails(root, verb):
        print(f"ssh: connect to host 10.0.0.2 port 22: Connection timed out ({verb})", file=sys.stderr)
        return 255
    if verb == "ssh":
        return _ssh(root, rest[0], _option(rest, "--command") or "")
    if verb == "scp":
        positional = [a for a in rest if not a.startswith("--")]
        name, dest = positional[-1].split(":", 1)
        for home in _workers(root, name):
            for source in positional[:-1]:
                shutil.copy(source, os.path.join(home, dest))
        return 0
    raise AssertionError(f"not stood in: {argv}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
