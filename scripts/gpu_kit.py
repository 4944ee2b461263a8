"""Build the offline GPU kit: ``make gpu-kit`` (``python scripts/gpu_kit.py``).

Writes into one folder the wheels that a GPU machine with its own torch
typically lacks, for that machine's Python, so that ``scripts/gpu-check.sh``
can install them there without a package index:

- this package's runtime dependencies (``pyproject.toml``) less those a CUDA
  or ROCm image with torch already has (``TARGET_HAS``), with their whole
  dependency closure, resolved for the target Python and platform;
- optionally NIXL for the target's CUDA major (``--nixl cu12|cu13``), without
  its dependencies (torch and numpy, which the machine has) and without its
  ``nixl_ep_*`` package: NIXL's expert-parallel kernels, one build per torch
  minor, about half the wheel, which nothing here imports (``--keep-nixl-ep``
  keeps the wheel as published).

torch, numpy and ``nvidia-*`` (and the packages in ``TARGET_HAS``) are never
downloaded: the closure is resolved from metadata first, and they are left out
of it, for the machine's own builds. atom-kv itself is not in the kit: the machine
runs the checkout in place (the tests and the bench come from it anyway).

Also writes ``requirements.txt`` (what ``gpu-check.sh`` installs) and
``manifest.json`` (Python version, platform, NIXL variant, every wheel with
its size), prints the folder's size, and refuses in one line, leaving no
manifest, when the folder is larger than ``--max-mib``.

Standard library only; runs pip through ``--python``'s interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what a GPU image with torch already has (the issue's air-gapped machine):
#: never put in the kit, so the machine's own builds are used
TARGET_HAS = frozenset({
    "numpy", "aiohttp", "uvloop", "prometheus-client", "msgpack", "pytest", "pytest-timeout", "hypothesis",
    "psutil",
})
#: must never be resolved into the kit: the machine's own GPU stack
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|numpy|nvidia-.*|pytorch-triton.*)$")
NIXL_REQUIREMENT = {"cu12": "nixl-cu12>=1.5,<2", "cu13": "nixl-cu13>=1.5,<2"}
MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"


class KitError(Exception):
    """A one-line reason the kit cannot be built."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements() -> list[str]:
    """pyproject.toml's runtime dependencies the target lacks."""
    try:
        import tomllib
    except ImportError:
        raise KitError("reading pyproject.toml needs Python >= 3.11 on this side (PY=python3.11 or newer)") from None
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if canonical(re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0]) not in TARGET_HAS]


def pip(python: str, args: list[str], quiet: bool = True) -> None:
    cmd = [python, "-m", "pip", *args, "--disable-pip-version-check"] + (["--quiet"] if quiet else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise KitError(f"pip {args[0]} failed (exit {proc.returncode}): {tail}")


def target_flags(args: argparse.Namespace) -> list[str]:
    return ["--only-binary=:all:", "--python-version", args.python_version, "--implementation", "cp",
            "--platform", args.platform]


def resolve(args: argparse.Namespace, requirements: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(name, version) of every wheel the requirements need on the target, and the names left
    to the machine (``NEVER`` and ``TARGET_HAS``), resolved from metadata before anything is downloaded."""
    with tempfile.TemporaryDirectory(prefix="gpu-kit-resolve-") as tmp:
        report = os.path.join(tmp, "report.json")
        pip(args.python, ["install", "--dry-run", "--ignore-installed", "--report", report,
                          "--target", os.path.join(tmp, "target"), *target_flags(args), *requirements])
        with open(report, encoding="utf-8") as f:
            items = json.load(f)["install"]
    pins = [(item["metadata"]["name"], item["metadata"]["version"]) for item in items]

    asked = {canonical(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in args.extra}

    def machines(name: str) -> bool:  # --extra names what this machine lacks after all
        return bool(NEVER.match(canonical(name))) or (canonical(name) in TARGET_HAS and canonical(name) not in asked)

    return [p for p in pins if not machines(p[0])], sorted(canonical(n) for n, _ in pins if machines(n))


def slim_nixl(path: str) -> int:
    """Drop the ``nixl_ep_*`` package (and its RECORD lines) from a NIXL wheel; bytes saved."""
    before = os.path.getsize(path)
    tmp = path + ".partial"

    def dropped(name: str) -> bool:
        return name.split("/", 1)[0].startswith("nixl_ep_")

    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w") as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode("utf-8").splitlines(keepends=True)
                data = "".join(line for line in lines if not dropped(line.split(",", 1)[0])).encode("utf-8")
            dst.writestr(info, data)
    os.replace(tmp, path)
    return before - os.path.getsize(path)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if os.path.isfile(os.path.join(path, f)))


def prepare_dir(kit: str) -> None:
    """An empty kit folder; an existing one is emptied only when it is a kit (wheels and our files)."""
    os.makedirs(kit, exist_ok=True)
    ours = {MANIFEST, REQUIREMENTS}
    foreign = [f for f in os.listdir(kit) if not (f.endswith(".whl") or f in ours)]
    if foreign:
        raise KitError(f"{kit} holds files that are not a kit's ({', '.join(sorted(foreign)[:3])}); "
                       "name an empty or new folder with KIT_DIR")
    for f in os.listdir(kit):
        os.remove(os.path.join(kit, f))


def source_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def build(args: argparse.Namespace) -> dict:
    kit = os.path.abspath(args.kit_dir)
    requirements = project_requirements() + list(args.extra)
    pins, left = resolve(args, requirements)
    prepare_dir(kit)
    pip(args.python, ["download", "--no-deps", "-d", kit, *target_flags(args),
                      *[f"{name}=={version}" for name, version in pins]])
    nixl_file, saved = None, 0
    if args.nixl != "none":
        pip(args.python, ["download", "--no-deps", "-d", kit, *target_flags(args), NIXL_REQUIREMENT[args.nixl]])
        nixl_file = next(f for f in os.listdir(kit) if canonical(f).startswith(f"nixl-{args.nixl}"))
        if not args.keep_nixl_ep:
            saved = slim_nixl(os.path.join(kit, nixl_file))
        requirements.append(NIXL_REQUIREMENT[args.nixl])
    with open(os.path.join(kit, REQUIREMENTS), "w", encoding="utf-8") as f:
        f.write("# installed by scripts/gpu-check.sh with --no-index --find-links <this folder>\n")
        f.writelines(r + "\n" for r in requirements)
    wheels = sorted(f for f in os.listdir(kit) if f.endswith(".whl"))
    total = folder_bytes(kit)
    manifest = {
        "python_version": args.python_version,
        "platform": args.platform,
        "nixl": args.nixl,
        "nixl_wheel": nixl_file,
        "nixl_ep_removed_bytes": saved,
        "requirements": requirements,
        "assumed_on_machine": sorted(TARGET_HAS | {"torch"}),
        "resolved_but_left_to_machine": left,
        "wheels": [{"file": w, "bytes": os.path.getsize(os.path.join(kit, w))} for w in wheels],
        "source_commit": source_commit(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "max_bytes": int(args.max_mib * 2**20),
    }
    manifest["total_bytes"] = total + len(json.dumps(manifest, indent=2)) + 64
    if manifest["total_bytes"] > manifest["max_bytes"]:
        raise KitError(f"{args.kit_dir} is {manifest['total_bytes'] / 2**20:.1f} MiB, over the {args.max_mib:g} MiB "
                       f"limit (NIXL={args.nixl}); no manifest written, so gpu-check.sh will not use it")
    with open(os.path.join(kit, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_kit.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python, e.g. 3.12")
    p.add_argument("--nixl", choices=["cu12", "cu13", "none"], default="cu13",
                   help="NIXL for the machine's CUDA major (torch.version.cuda there), or none")
    p.add_argument("--kit-dir", default=os.path.join(ROOT, "gpu-kit"))
    p.add_argument("--platform", default="manylinux_2_28_x86_64",
                   help="the machine's wheel platform (manylinux_2_28 covers glibc >= 2.28 on x86_64)")
    p.add_argument("--max-mib", type=float, default=60.0, help="refuse a kit larger than this")
    p.add_argument("--extra", action="append", default=[],
                   help="one more requirement for the kit (repeatable), e.g. one the machine lacks after all")
    p.add_argument("--keep-nixl-ep", action="store_true", help="keep NIXL's nixl_ep_* package in its wheel")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose pip downloads")
    args = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        print(f"gpu-kit: PYTHON_VERSION must look like 3.12, got {args.python_version!r}", file=sys.stderr)
        return 2
    try:
        m = build(args)
    except KitError as exc:
        print(f"gpu-kit: {exc}", file=sys.stderr)
        return 1
    nixl = f"NIXL {m['nixl_wheel']}" + (f" without nixl_ep ({m['nixl_ep_removed_bytes'] / 2**20:.1f} MiB less)"
                                        if m["nixl_ep_removed_bytes"] else "") if m["nixl_wheel"] else "no NIXL"
    print(f"gpu-kit: {len(m['wheels'])} wheels for CPython {m['python_version']} ({m['platform']}), {nixl}: "
          f"{m['total_bytes'] / 2**20:.1f} MiB in {args.kit_dir} (limit {args.max_mib:g} MiB); "
          f"copy it with the checkout and run scripts/gpu-check.sh OUTDIR there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
