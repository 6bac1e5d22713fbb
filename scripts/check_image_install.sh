#!/usr/bin/env bash
# The Dockerfile's install steps without a docker engine: build the wheel (stage `wheel`), install
# TORCH_SPEC and then the wheel with the etcd extra into a fresh venv (the final stage), and check
# from outside the checkout that the installed package works: the console script, both
# entry-point groups (torchsnapshot's storage plugin, torchrun's etcd3 handler), every module of
# the checkout in the wheel, no test extras,
# and a one-node job of examples/train.py that saves through the `torchrevive://` plugin.
# TORCH_SPEC defaults to torch==2.13.0 (pip's configured wheels here: the CPU build).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=${PYTHON:-python3}

"$python" -m venv "$work/build"
"$work/build/bin/pip" install -q setuptools wheel
"$work/build/bin/pip" wheel -q --no-deps --no-build-isolation --wheel-dir "$work/wheels" "$repo"

"$python" -m venv "$work/venv"
# shellcheck disable=SC2086  # unquoted as in the Dockerfile: the spec may carry pip options
"$work/venv/bin/pip" install -q ${TORCH_SPEC:-torch==2.13.0}
"$work/venv/bin/pip" install -q "$(ls "$work"/wheels/torchrevive-*.whl)[etcd]"

cd "$work"  # the checkout must not be importable: only the installed copy counts
REPO="$repo" "$work/venv/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util

for group, name in [("storage_plugins", "torchrevive"), ("torchrun.handlers", "etcd3")]:
    points = [ep for ep in md.entry_points(group=group) if ep.name == name]
    assert len(points) == 1, f"entry point {group}:{name} is not registered: {points}"
    print(f"entry point {group}:{name} -> {points[0].value} loads {points[0].load()!r}")
for extra in ("pytest", "hypothesis"):
    assert importlib.util.find_spec(extra) is None, f"{extra} is installed: the image must not carry test extras"
spec = importlib.util.find_spec("agent")
assert spec.origin and "site-packages" in spec.origin, f"agent imported from {spec.origin}, not the installed wheel"
direct_url = md.distribution("torchrevive").read_text("direct_url.json") or ""
assert '"editable": true' not in direct_url, f"torchrevive is installed editable: {direct_url}"
print("installed from", spec.origin)
import os, pathlib
installed = pathlib.Path(spec.origin).parents[1]
for package in ("agent", "launcher"):  # every module of the checkout is in the wheel
    source = pathlib.Path(os.environ["REPO"]) / package
    missing = [str(f.relative_to(source.parent)) for f in source.rglob("*.py")
               if not (installed / f.relative_to(source.parent)).exists()]
    assert not missing, f"modules missing from the wheel: {missing}"
PY
"$work/venv/bin/torchrevive" --help >/dev/null
"$work/venv/bin/torchrevive" run --help >/dev/null

# A real job from the installed package: 1 node, 2 workers, DDP on gloo, snapshots every 2 steps.
cp -r "$repo/examples" "$work/examples"
cat >"$work/job.yaml" <<YAML
job: {id: image-check, nproc_per_node: 2}
checkpoint: {dir: $work/checkpoints, interval_steps: 2, keep: 2}
YAML
env -u PYTHONPATH OMP_NUM_THREADS=1 "$work/venv/bin/torchrevive" run --config "$work/job.yaml" \
  --standalone examples/train.py --steps 4 --samples 256 --width 64 >"$work/job.log" 2>&1 \
  || { tail -40 "$work/job.log"; exit 1; }
"$work/venv/bin/torchrevive" list "$work/checkpoints"
"$work/venv/bin/torchrevive" verify "$(ls -d "$work"/checkpoints/step_* | sort -V | tail -1)"
echo "image install check: OK"
