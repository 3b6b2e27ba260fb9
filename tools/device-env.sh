# shellcheck shell=bash
# Sourced by tools/gpu-check and tools/gpu-train on a GPU machine without network: stages the parts of
# `tools/gpu-pack` this command carries (.device/pK) in /tmp/specserve-device, installs the packed
# wheels and this project (editable), and once every part has arrived unpacks the bundle: the model
# (SPECSERVE_GGUF), the drafters' checkpoints (copied into drafters/checkpoints) and the prompt pool
# (SPECSERVE_DATA/train_prompts.jsonl beside the benchmark sets). Parts staged by an earlier command
# on the same machine stay in /tmp/specserve-device.
#
# Needs $root (the project), $log and a `say` function; sets $py, $device_ready (1 once the bundle is
# unpacked, else 0) and $status=1 when a step failed.
py=${PYTHON:-python3}
d=/tmp/specserve-device
mkdir -p "$d"
for p in .device/p*/; do
  [ -d "$p" ] && cp -r "$p". "$d"/ && say "staged $p"
done
if [ -d "$d/wheels" ] && [ ! -f "$d/.wheels-installed" ]; then
  if "$py" -m pip install -q --no-index --no-deps "$d"/wheels/*.whl >>"$log" 2>&1; then
    touch "$d/.wheels-installed"
  else
    say "installing the packed wheels failed"; status=1
  fi
fi
# this tree, editable, unless it is what the interpreter imports already
here=$("$py" -c 'import pathlib, specserve.engine as e; print(pathlib.Path(e.__file__).parents[1])' 2>/dev/null)
if [ "$here" != "$root" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$log" 2>&1 \
    || { say "installing the project failed"; status=1; }
fi
export SPECSERVE_DATA=$d/data SPECSERVE_CACHE=$d/cache
device_ready=0
n=$(cat "$d/bundle.parts" 2>/dev/null || echo 0)
have=$(find "$d" -maxdepth 1 -name 'bundle.part[0-9]*' | wc -l)
if [ "$n" -gt 0 ] && [ "$have" -ge "$n" ]; then
  if [ ! -f "$d/model.gguf" ]; then
    for k in $(seq 1 "$n"); do cat "$d/bundle.part$k"; done > "$d/bundle.tar"
    if echo "$(cat "$d/bundle.sha256")  $d/bundle.tar" | sha256sum -c --quiet -; then
      tar -xf "$d/bundle.tar" -C "$d" && rm "$d/bundle.tar"
      [ -f "$d/data/train_prompts.jsonl.gz" ] && gunzip -f "$d/data/train_prompts.jsonl.gz"
    else
      say "the bundle's checksum does not match: parts from different packs?"; status=1
    fi
  fi
  if [ -f "$d/model.gguf" ]; then
    mkdir -p drafters/checkpoints && cp -r "$d/drafters/checkpoints/." drafters/checkpoints/
    export SPECSERVE_GGUF=$d/model.gguf
    device_ready=1
    say "model, drafters' checkpoints and prompt pool ready"
  fi
else
  say "bundle: $have of $n parts staged; what needs the model waits for the rest"
fi
