"""``bench routing``'s outside-client row: aiperf, ``kv_aware`` against ``cache_aware``, on fresh engines.

aiperf (NVIDIA's AI-Perf, ``pip install aiperf`` into its own virtualenv: it is no dependency of this
package) is run as a subprocess once per policy, each time on new engines and a new proxy
(:func:`atom_kv.bench.routing_run.policy_cluster`), with the same flags: the chat endpoint, streamed, one
shared system prompt (``--shared-system-prompt-length``) ahead of every conversation's user turns
(``--conversation-turn-mean``: each turn carries the conversation so far), a constant request rate, the
same request count and seed. Token counts are the engine's own (``--use-server-token-count``); aiperf
still loads a tokenizer to make its prompts, and gets the reference engine's byte-level one as a local
directory (:mod:`atom_kv.bench.hf_byte_tokenizer`), so nothing is fetched from the Hugging Face Hub.

Each run has a wall-clock timeout (its process group is killed past it), its output goes to a file of
which only the last lines are read, and every failure becomes :class:`AiperfError` with one line saying
what went wrong. :func:`parse_export` reads aiperf's summary export (``profile_export_aiperf.json``):
output tok/s, TTFT p90, requests that succeeded and failed. :func:`outside_client_target` compares the
two runs: met if kv_aware has >= 1.2x cache_aware's output tok/s or <= 0.5x its TTFT p90, compared only
when both runs had the same success rate.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

from atom_kv.bench import hf_byte_tokenizer
from atom_kv.bench.targets import Target

__all__ = ["AiperfError", "AiperfResult", "AiperfWorkload", "EXPORT_NAME", "MODEL", "POLICIES", "aiperf_argv",
           "find_aiperf", "outside_client_target", "parse_export", "run_aiperf"]

#: the summary aiperf writes into its artifact directory
EXPORT_NAME = "profile_export_aiperf.json"
#: the reference engine's served model (its --model-id default)
MODEL = "atom-kv-tiny"
#: (candidate, base), in the order they run
POLICIES = ("cache_aware", "kv_aware")
TARGET_NAME = "an outside client"
CLAIM = "aiperf, kv_aware >= 1.2 x cache_aware output tok/s or TTFT p90 <= 0.5 x"
MAX_EXPORT_BYTES = 8 << 20  # a summary export is tens of KB
TAIL_BYTES = 4096  # what is read back of aiperf's output, for the reason of a failure
#: aiperf in offline mode takes a tokenizer path for a Hub repository id and fails; a local path needs none
_DROPPED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class AiperfError(RuntimeError):
    """One aiperf run that gave no figures; the message is one line saying why."""


@dataclass(frozen=True)
class AiperfWorkload:
    """What aiperf sends, the same for both policies."""

    request_rate: float  # requests/s, constant arrivals
    request_count: int
    system_prompt_tokens: int  # one system prompt shared by every conversation
    input_tokens: int  # each user turn
    output_tokens: int  # each answer (the reference engine never stops early)
    turns: int  # per conversation
    seed: int
    request_timeout_s: float  # per request, aiperf's own
    timeout_s: float  # the whole aiperf run


@dataclass(frozen=True)
class AiperfResult:
    """The figures of one aiperf run, from its summary export."""

    output_tok_s: float
    ttft_p90_ms: float
    succeeded: int
    failed: int
    request_rate: float  # achieved, requests/s

    @property
    def success_rate(self) -> float:
        total = self.succeeded + self.failed
        return self.succeeded / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"output_tok_s": round(self.output_tok_s, 3), "ttft_p90_ms": round(self.ttft_p90_ms, 3),
                "succeeded": self.succeeded, "failed": self.failed,
                "success_rate": round(self.success_rate, 4), "request_rate": round(self.request_rate, 3)}


def find_aiperf(path: Optional[str]) -> tuple[Optional[str], str]:
    """(the aiperf executable, "") from ``--aiperf PATH`` or, without one, ``aiperf`` on PATH; else (None, why)."""
    if path is None:
        found = shutil.which("aiperf")
        if found is None:
            return None, ("aiperf is not on PATH; install it into its own virtualenv (pip install aiperf) and "
                          "pass --aiperf VENV/bin/aiperf")
        return found, ""
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return None, f"--aiperf {path}: not an executable file (give the aiperf executable, e.g. VENV/bin/aiperf)"
    return os.path.abspath(path), ""


def aiperf_argv(exe: str, url: str, workload: AiperfWorkload, tokenizer_dir: str, artifact_dir: str) -> list[str]:
    """aiperf's command line for one run against the proxy at ``url``."""
    w = workload
    argv = [exe, "profile", "--url", url, "--model", MODEL, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", tokenizer_dir, "--use-server-token-count",
            "--shared-system-prompt-length", str(w.system_prompt_tokens),
            "--isl", str(w.input_tokens), "--isl-stddev", "0", "--osl", str(w.output_tokens),
            "--request-rate", f"{w.request_rate:g}", "--arrival-pattern", "constant",
            "--request-count", str(w.request_count), "--random-seed", str(w.seed),
            "--request-timeout-seconds", f"{w.request_timeout_s:g}",
            "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--export-level", "summary",
            "--artifact-dir", artifact_dir, "--workers-max", "2"]
    if w.turns > 1:
        argv += ["--conversation-turn-mean", str(w.turns), "--conversation-turn-stddev", "0",
                 "--conversation-num", str(max(1, math.ceil(w.request_count / w.turns)))]
    return argv


def _tail(path: str) -> str:
    """The last non-empty line of aiperf's output file (at most TAIL_BYTES read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
            text = f.read(TAIL_BYTES).decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(its output could not be read: {exc})"
    lines = [line.strip(" │\t") for line in text.splitlines() if line.strip(" │\t─╭╮╰╯")]
    return lines[-1][:300] if lines else "(no output)"


def run_aiperf(argv: list[str], artifact_dir: str, timeout_s: float) -> AiperfResult:
    """Run aiperf (its own process group; output to ``artifact_dir``/aiperf.out) and parse its export.
    Raises AiperfError with one line: it could not start, ran past ``timeout_s`` (its group is killed),
    exited non-zero (its last line of output), or left no readable export."""
    os.makedirs(artifact_dir, exist_ok=True)
    out_path = os.path.join(artifact_dir, "aiperf.out")
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    with open(out_path, "wb") as out:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=artifact_dir, start_new_session=True)
        except OSError as exc:
            raise AiperfError(f"aiperf did not start ({argv[0]}): {exc}") from None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise AiperfError(f"aiperf ran past {timeout_s:g} s and was stopped (output in {out_path})") from None
        finally:
            if proc.poll() is None:  # interrupted while waiting: leave nothing behind
                _kill_group(proc)
    if rc != 0:
        raise AiperfError(f"aiperf exited with {rc}: {_tail(out_path)} (output in {out_path})")
    return parse_export(os.path.join(artifact_dir, EXPORT_NAME))


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to aiperf's process group (its services are its children), SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _metric(doc: dict[str, Any], key: str, stat: str, path: str, default: Optional[float] = None) -> float:
    entry = doc.get(key)
    if entry is None and default is not None:
        return default
    value = entry.get(stat) if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise AiperfError(f"{path}: {key}.{stat} is missing or not a number >= 0 (is this aiperf's "
                          f"{EXPORT_NAME}?)")
    return float(value)


def parse_export(path: str) -> AiperfResult:
    """The figures of aiperf's summary export at ``path``; AiperfError (one line naming the key) when it is
    missing, too large, not JSON, cancelled, or lacks a figure."""
    try:
        size = os.path.getsize(path)
        if size > MAX_EXPORT_BYTES:
            raise AiperfError(f"{path}: {size} bytes, more than the {MAX_EXPORT_BYTES} a summary export takes")
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        raise AiperfError(f"aiperf wrote no {EXPORT_NAME} in {os.path.dirname(path)}") from None
    except (OSError, ValueError) as exc:
        raise AiperfError(f"{path}: not readable JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise AiperfError(f"{path}: the export is not a JSON object")
    if doc.get("was_cancelled") is True:
        raise AiperfError(f"{path}: aiperf says the run was cancelled")
    succeeded = _metric(doc, "request_count", "avg", path, default=0.0)
    failed = _metric(doc, "error_request_count", "avg", path, default=0.0)  # present only when some failed
    if succeeded == 0:
        raise AiperfError(f"{path}: no request succeeded ({failed:g} failed: {_errors(doc)})")
    return AiperfResult(output_tok_s=_metric(doc, "output_token_throughput", "avg", path),
                        ttft_p90_ms=_metric(doc, "time_to_first_token", "p90", path),
                        succeeded=int(succeeded), failed=int(failed),
                        request_rate=_metric(doc, "request_throughput", "avg", path))


def _errors(doc: dict[str, Any]) -> str:
    summary = doc.get("error_summary")
    if not isinstance(summary, list) or not summary:
        return "no error summary"
    return "; ".join(str(item)[:120] for item in summary[:3])


def outside_client_target(results: dict[str, AiperfResult | str]) -> Target:
    """The row from both runs' results (or each failed run's one-line reason)."""
    for name in POLICIES:
        got = results.get(name)
        if not isinstance(got, AiperfResult):
            return Target(TARGET_NAME, f"{CLAIM}: not run ({name}: {got or 'no result'})", None)
    kv, ca = results["kv_aware"], results["cache_aware"]
    assert isinstance(kv, AiperfResult) and isinstance(ca, AiperfResult)
    tok = kv.output_tok_s / ca.output_tok_s if ca.output_tok_s else math.inf
    ttft = kv.ttft_p90_ms / ca.ttft_p90_ms if ca.ttft_p90_ms else math.inf
    figures = (f"output {kv.output_tok_s:.1f} against {ca.output_tok_s:.1f} tok/s ({tok:.2f}x), TTFT p90 "
               f"{kv.ttft_p90_ms:.1f} against {ca.ttft_p90_ms:.1f} ms ({ttft:.2f}x), "
               f"{kv.succeeded}/{kv.succeeded + kv.failed} and {ca.succeeded}/{ca.succeeded + ca.failed} succeeded")
    if (kv.succeeded, kv.failed) != (ca.succeeded, ca.failed):
        return Target(TARGET_NAME, f"{CLAIM}: not compared, the success rates differ ({figures})", None)
    return Target(TARGET_NAME, f"{CLAIM}: {figures}", tok >= 1.2 or ttft <= 0.5)


def run_row(exe: str, workload: AiperfWorkload, start_cluster: Callable[[str, str], Any], log_root: str,
            say: Callable[[str], None]) -> tuple[Target, dict[str, Any]]:
    """Both policies' aiperf runs, each on the cluster ``start_cluster(policy, log_dir)`` gives (a context
    manager yielding a started :class:`~atom_kv.testing.cluster.Cluster`); the row and the figures."""
    tokenizer_dir = hf_byte_tokenizer.write(tempfile.mkdtemp(prefix="atom-kv-byte-tokenizer-"))
    results: dict[str, AiperfResult | str] = {}
    try:
        for name in POLICIES:
            say(f"aiperf: {name} ...")
            log_dir = os.path.join(log_root, f"aiperf-{name}")
            try:
                with start_cluster(name, log_dir) as cluster:
                    argv = aiperf_argv(exe, cluster.proxy_url, workload, tokenizer_dir,
                                       os.path.join(log_dir, "artifacts"))
                    results[name] = run_aiperf(argv, os.path.join(log_dir, "artifacts"), workload.timeout_s)
            except Exception as exc:  # the cluster's or aiperf's: that policy's run gives no figures, said in one line
                results[name] = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
                say(f"aiperf: {name}: {results[name]}")
    finally:
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
    figures = {k: {"status": "ok", **v.as_dict()} if isinstance(v, AiperfResult) else {"status": "failed", "reason": v}
               for k, v in results.items()}
    return outside_client_target(results), figures
