#!/usr/bin/env python3
"""The NVIDIA wheels libtorch needs, read from the torch wheel's own metadata (scripts/setup/setup.sh).

torch's METADATA requires, on Linux, a few `nvidia-*` packages directly (cuDNN, cuSPARSELt, NCCL,
NVSHMEM) and the CUDA toolkit through the `cuda-toolkit[cublas,cudart,...]` meta-package, whose
own METADATA maps each extra to an `nvidia-*` wheel. This prints one requirement per line:

    torch_cuda_deps.py TORCH_WHEEL_OR_METADATA toolkit-requirement
        the `cuda-toolkit[...]==X` requirement (to download that wheel), or nothing
    torch_cuda_deps.py TORCH_WHEEL_OR_METADATA gpu TOOLKIT_WHEEL_OR_METADATA
        every NVIDIA wheel libtorch_cuda.so and its siblings link against
    torch_cuda_deps.py TORCH_WHEEL_OR_METADATA cpu TOOLKIT_WHEEL_OR_METADATA
        the ones libtorch_cpu.so needs even without a GPU (CUDA runtime, CUPTI) and NVRTC
        (kernels/ compiles its CUDA sources at run time)

Markers are evaluated for this machine (Linux, this Python), with pip's vendored `packaging`.
"""

import sys
import zipfile

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always carries it
    from pip._vendor.packaging.requirements import Requirement

# cuda-toolkit extras libtorch_cpu.so (cudart, cupti) and the NVRTC kernels need on any machine.
CPU_EXTRAS = {"cudart", "cupti", "nvrtc"}


def metadata(path):
    """METADATA text of a wheel, or of a METADATA file itself."""
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            return z.read(name).decode("utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


def requirements(text, extras=("",)):
    """Requires-Dist entries whose markers hold here for one of `extras`."""
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
            out.append(req)
    return out


def spec(req):
    return f"{req.name}{req.specifier}"


def main():
    torch_meta, mode = sys.argv[1], sys.argv[2]
    reqs = requirements(metadata(torch_meta))
    toolkit = [r for r in reqs if r.name == "cuda-toolkit"]
    if mode == "toolkit-requirement":
        for r in toolkit:
            print(spec(r))
        return
    toolkit_meta = metadata(sys.argv[3]) if toolkit else ""
    wanted = set()
    for r in toolkit:
        extras = set(r.extras) if mode == "gpu" else set(r.extras) & CPU_EXTRAS
        for dep in requirements(toolkit_meta, tuple(sorted(extras)) or ("",)):
            # Only the extras asked for: the toolkit also lists them all under "all".
            if dep.marker is not None and any(dep.marker.evaluate({"extra": e}) for e in extras):
                wanted.add(spec(dep))
    if mode == "gpu":
        wanted.update(spec(r) for r in reqs if r.name.startswith("nvidia-"))
    for w in sorted(wanted):
        print(w)


if __name__ == "__main__":
    main()
