"""Cases of the commands that start processes: run, profile, sweep, treat, gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import LEAK, LOSS, ORPHAN, WRONG, Case, Ctx, Obs, Signal
from kit import (
    FAST,
    HOSTILE,
    REPORT,
    SIGHUP,
    SIGINT,
    SIGKILL,
    SIGTERM,
    S,
    case,
    fifo,
    full,
    json_at,
    link,
    mkdir,
    put,
    put_report,
    readonly,
    rescued_or_written,
    script_never_ran,
    small_disk,
    stdout_json,
)

#: the progress bars printed as on a terminal (FORCE_COLOR): the moments the signals are sent at
PROGRESS = {"FORCE_COLOR": "1"}
#: a user's training script in miniature; what it does besides training is its first argument
TRAIN = r"""
import os, signal, subprocess, sys, time


def main():
    open("STARTED", "w").close()
    mode = sys.argv[1] if len(sys.argv) > 1 else "normal"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "ignore-signals":
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
    if mode == "daemon":
        ignores = "import signal, time; signal.signal(15, signal.SIG_IGN); time.sleep(300)"
        subprocess.Popen([sys.executable, "-c", ignores],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if mode == "helper-stdout":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    if mode == "chdir":
        os.makedirs("elsewhere", exist_ok=True)
        os.chdir("elsewhere")
    if mode == "profiler":
        prof = torch.profiler.profile(on_trace_ready=lambda p: p.export_chrome_trace("user_trace.json"))
        prof.__enter__()
    if mode == "doctor":
        import vlmdoctor
        doc = vlmdoctor.Doctor(model, out="own-doctor", warmup=1, steps=2, trace_steps=1, quiet=True).__enter__()
    if mode == "graceful":  # a script that saves a checkpoint when asked to stop (as schedulers ask: SIGTERM)
        def save_and_exit(signum, frame):
            open("CHECKPOINT", "w").write(str(signum))
            sys.exit(0)
        signal.signal(signal.SIGTERM, save_and_exit)
    loader = None
    if mode == "spawn-workers":
        data = torch.utils.data.TensorDataset(torch.randint(0, 64, (512, 16)))
        loader = iter(torch.utils.data.DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="spawn"))
    if mode == "workers":
        data = torch.utils.data.TensorDataset(torch.randint(0, 64, (512, 16)))
        loader = iter(torch.utils.data.DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True))
    for i in range(steps if mode not in ("no-step", "one-step") else 3):
        ids = next(loader)[0] if loader else torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(i))
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        if mode != "no-step" and not (mode == "one-step" and i > 0):
            opt.step()
        opt.zero_grad()
        if mode == "doctor":
            doc.step()
        if mode in ("slow", "ignore-signals", "daemon-slow", "quiet-slow", "graceful"):
            time.sleep(0.4)
        if mode == "noisy":
            sys.stdout.write(("y" * 1023 + "\n") * 2048)
        if mode == "fill" and i == 2:
            try:
                with open(os.environ["PROBE_FILL"], "wb") as f:
                    while True:
                        f.write(b"\0" * 65536)
            except OSError:
                pass
        if mode != "quiet-slow":
            print(f"step {i} loss {loss.item():.4f}", flush=True)
    if mode == "profiler":
        prof.__exit__(None, None, None)
    if mode == "doctor":
        doc.finish()
    if mode == "exit7":
        sys.exit(7)
    if mode == "memoryerror":
        raise MemoryError("the user's own allocation")
    if mode == "cpu-oom":
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes.")
    print("USER-DONE", flush=True)


if __name__ == "__main__":  # a DataLoader worker started with spawn imports this file again
    main()
"""

W = ["--warmup", "1", "--steps", "2", "--trace-steps", "1"]


def _run(*args: str, mode: str = "normal", steps: int = 12, out: str = "out") -> list[str]:
    return ["run", "--out", out, *W, *args, "--", "python", "train.py", mode, str(steps)]


def _train(rel: str = "train.py") -> object:
    return put(rel, TRAIN)


def _report_ok(rel: str = "out/report.json") -> object:
    return json_at(
        rel, lambda r: r.get("status") == "ok" and r["metrics"]["real_tokens_per_s"] > 0, "no measured report", LOSS
    )


def _trained_to_end(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    return [] if "USER-DONE" in obs.out else [(WRONG, "the script did not train to its end")]


def _no_orphan_quickly(limit: float):
    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        return [] if obs.wall_s < limit else [(WRONG, f"took {obs.wall_s:.0f} s (a helper held it up)")]

    return check


def _both(*checks):
    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        return [d for c in checks for d in c(ctx, obs)]

    return check


def run_cases() -> list[Case]:
    R = "run"
    cs = [
        case(
            "run/script-missing",
            R,
            "bad-value",
            "a script that does not exist: exit 2",
            _run(),
            needles=("no such script",),
        ),
        case(
            "run/script-fifo",
            R,
            "fifo",
            "the script is a fifo: exit 2 at once, never read",
            _run(),
            setup=fifo("train.py"),
            timeout=30,
            ci=False,
        ),
        case("run/script-folder", R, "wrong-type", "the script is a folder: exit 2", _run(), setup=mkdir("train.py")),
        case(
            "run/python-c",
            R,
            "bad-value",
            "run -- python -c CODE: exit 2",
            ["run", "--", "python", "-c", "open('PWNED','w')"],
        ),
        case(
            "run/torchrun",
            R,
            "processes",
            "run -- torchrun --nproc-per-node 1 train.py: followed, measured, exit 0, nothing left",
            ["run", "--out", "out", *W, "--", "torchrun", "--nproc-per-node", "1", "train.py"],
            setup=_train(),
            code=0,
            temp_ok=("torchelastic_*",),
            check=_report_ok(),
            heavy=True,
        ),
        case(
            "run/deepspeed",
            R,
            "bad-value",
            "run -- deepspeed train.py: exit 2 naming the launcher",
            ["run", "--", "deepspeed", "train.py"],
            setup=_train(),
        ),
        case("run/nothing", R, "bad-value", "run -- (no command): exit 2", ["run", "--"]),
        case("run/python-x-no-value", R, "bad-value", "run -- python -X: exit 2", ["run", "--", "python", "-X"]),
        case(
            "run/python-unknown-flag",
            R,
            "bad-value",
            "run -- python -Z train.py: exit 2",
            ["run", "--", "python", "-Z", "train.py"],
            setup=_train(),
        ),
        case(
            "run/out-is-file",
            R,
            "wrong-type",
            "--out names a file: exit 2 before the script starts",
            _run(),
            setup=S(_train(), put("out", "mine")),
            check=script_never_ran,
        ),
        case(
            "run/out-link-outside",
            R,
            "symlink",
            "--out a link to a folder outside: exit 2, nothing written outside",
            _run(),
            setup=S(_train(), link("out", "{outside}")),
            check=script_never_ran,
        ),
        case(
            "run/out-read-only",
            R,
            "read-only",
            "--out a read-only mount: exit 2 before the script starts",
            _run(),
            setup=S(_train(), readonly("out")),
            check=script_never_ran,
            ci=False,
        ),
        case(
            "run/out-full",
            R,
            "full-disk",
            "--out a full disk: exit 2 before the script starts",
            _run(),
            setup=S(_train(), full("out")),
            check=script_never_ran,
            ci=True,
        ),
        case(
            "run/out-html-fifo",
            R,
            "fifo",
            "OUT/report.html is a fifo: exit 2 before the script starts, no hang",
            _run("--force"),
            setup=S(_train(), fifo("out/report.html")),
            check=script_never_ran,
            timeout=30,
        ),
        case(
            "run/out-trace-file",
            R,
            "wrong-type",
            "OUT/trace is a file: exit 2 before the script starts",
            _run(),
            setup=S(_train(), put("out/trace", "mine")),
            check=script_never_ran,
        ),
        case(
            "run/out-trace-link",
            R,
            "symlink",
            "OUT/trace a link to a folder outside, --force: exit 2",
            _run("--force"),
            setup=S(_train(), link("out/trace", "{outside}")),
            check=script_never_ran,
        ),
        case(
            "run/report-exists",
            R,
            "output",
            "OUT/report.json from the user exists: exit 2 without --force, unchanged",
            _run(),
            setup=S(_train(), put("out/report.json", '{"mine": 1}')),
            check=script_never_ran,
        ),
        case(
            "run/json-is-script",
            R,
            "output",
            "--json naming the script, --force: refused, the script unchanged",
            _run("--json", "train.py", "--force"),
            setup=_train(),
            check=script_never_ran,
        ),
        case(
            "run/html-is-script-dotslash",
            R,
            "output",
            "--html ./train.py --force: refused",
            _run("--html", "./train.py", "--force"),
            setup=_train(),
            check=script_never_ran,
        ),
        case(
            "run/steps-zero",
            R,
            "bad-value",
            "--steps 0: exit 2",
            ["run", "--steps", "0", "--", "python", "train.py"],
            setup=_train(),
        ),
        case(
            "run/warmup-negative",
            R,
            "bad-value",
            "--warmup -1: exit 2",
            ["run", "--warmup", "-1", "--", "python", "train.py"],
            setup=_train(),
        ),
        case(
            "run/stage-3",
            R,
            "bad-value",
            "--stage 3: exit 2",
            ["run", "--stage", "3", "--", "python", "train.py"],
            setup=_train(),
        ),
        case(
            "run/trace-steps-huge",
            R,
            "bad-value",
            "--trace-steps 10**12: exit 2, or the run stops at its end",
            _run("--trace-steps", str(10**12)),
            setup=_train(),
            code=(0, 1, 2),
            heavy=True,
        ),
        case(
            "run/hostile-script-name",
            R,
            "hostile-string",
            "a script named with markup and escapes: runs, exit 0, no console crash",
            ["run", "--out", "out", *W, "--", "python", "t[/]" + "\x1b[2J.py"],
            setup=put("t[/]\x1b[2J.py", TRAIN),
            code=0,
            heavy=True,
        ),
    ]
    # --- real runs -----------------------------------------------------------------------------------------------
    cs += [
        case(
            "run/normal",
            R,
            "baseline",
            "a plain run: exit 0, a measured report, the script trains to its end",
            _run(),
            setup=_train(),
            code=0,
            check=_both(_report_ok(), _trained_to_end),
            heavy=True,
        ),
        case(
            "run/no-step",
            R,
            "wrong-type",
            "a script that never steps its optimizer: exit 1 saying so",
            _run(mode="no-step"),
            setup=_train(),
            code=1,
            needles=("optimizer step",),
            heavy=True,
        ),
        case(
            "run/one-step",
            R,
            "wrong-type",
            "a script that steps once: exit 1 saying two are needed",
            _run(mode="one-step"),
            setup=_train(),
            code=1,
            needles=("at least 2",),
            heavy=True,
        ),
        case(
            "run/exit-7",
            R,
            "user-error",
            "the script exits 7 after the window: exit 1, its code in the report",
            _run(mode="exit7"),
            setup=_train(),
            code=1,
            check=json_at("out/report.json", lambda r: r["script"]["exit_code"] == 7, "exit code 7 not recorded", LOSS),
            heavy=True,
        ),
        case(
            "run/memory-error",
            R,
            "oom",
            "the script raises MemoryError: exit 3, status oom",
            _run(mode="memoryerror"),
            setup=_train(),
            code=3,
            check=json_at("out/report.json", lambda r: r["status"] == "oom", "status is not oom"),
            heavy=True,
        ),
        case(
            "run/cpu-allocator-oom",
            R,
            "oom",
            "the script dies in torch's CPU allocator: exit 3",
            _run(mode="cpu-oom"),
            setup=_train(),
            code=3,
            heavy=True,
        ),
        case(
            "run/own-profiler",
            R,
            "profiler",
            "the script runs its own torch.profiler over every step: no crash, its trace written, exit 0",
            _run(mode="profiler"),
            setup=_train(),
            code=0,
            creates=("work/user_trace.json",),
            check=_trained_to_end,
            heavy=True,
        ),
        case(
            "run/own-doctor",
            R,
            "profiler",
            "the script uses vlmdoctor.Doctor itself: no crash, exit 0",
            _run(mode="doctor"),
            setup=_train(),
            code=0,
            check=_trained_to_end,
            heavy=True,
            ci=False,
        ),
        case(
            "run/daemon",
            R,
            "processes",
            "the script leaves a daemon (own session, ignores SIGTERM): stopped, said, exit 0",
            _run(mode="daemon"),
            setup=_train(),
            code=0,
            needles=("process",),
            heavy=True,
        ),
        case(
            "run/helper-holds-stdout",
            R,
            "processes",
            "a helper holds the script's stdout after it exits: run returns at once, the helper stopped",
            _run(mode="helper-stdout"),
            setup=_train(),
            code=0,
            check=_no_orphan_quickly(40),
            heavy=True,
        ),
        case(
            "run/dataloader-workers",
            R,
            "processes",
            "the script's DataLoader workers: none left, exit 0",
            _run(mode="workers"),
            setup=_train(),
            code=0,
            heavy=True,
        ),
        case(
            "run/spawn-workers",
            R,
            "processes",
            "the script's DataLoader workers started with 'spawn' (they import the script again): they train, "
            "none left, exit 0",
            _run(mode="spawn-workers"),
            setup=_train(),
            code=0,
            check=_trained_to_end,
            heavy=True,
        ),
        case(
            "run/script-saves-on-sigterm",
            R,
            "signal",
            "SIGTERM to run while the script trains; the script saves a checkpoint when asked: it gets SIGTERM first "
            "and saves, exit 143",
            _run(mode="graceful", steps=60),
            setup=_train(),
            signals=[Signal("out:warm-up done", SIGTERM)],
            code=143,
            creates=("work/CHECKPOINT",),
            heavy=True,
        ),
        case(
            "run/chdir",
            R,
            "wrong-type",
            "the script changes its folder before training: the report still in --out, exit 0",
            _run(mode="chdir"),
            setup=_train(),
            code=0,
            check=_report_ok(),
            heavy=True,
        ),
        case(
            "run/json-dash",
            R,
            "output",
            "--json -: stdout is the report alone (the script's output on stderr)",
            _run("--json", "-"),
            setup=_train(),
            code=0,
            check=stdout_json(lambda r: r.get("status") == "ok", "not the report"),
            heavy=True,
        ),
        case(
            "run/noisy",
            R,
            "huge",
            "a script that prints 20 MB: the log holds it, memory bounded, exit 0",
            _run(mode="noisy", steps=10),
            setup=_train(),
            code=0,
            check=lambda ctx, obs: (
                [] if (ctx.work / "out/script.log").stat().st_size > 20e6 else [(LOSS, "the log lost output")]
            ),
            heavy=True,
        ),
        case(
            "run/disk-fills",
            R,
            "full-disk",
            "the script fills --out's disk during training: it trains to its end; the report is written or rescued "
            "and named",
            _run(mode="fill"),
            setup=S(_train(), small_disk("out", "40m")),
            env={"PROBE_FILL": "{work}/out/ballast"},
            code=(0, 1),
            may_change=("work/out/*",),
            check=_both(_trained_to_end, rescued_or_written("out/report.json")),
            heavy=True,
            aims=LEAK,
        ),
        case(
            "run/tmp-read-only",
            R,
            "read-only",
            "TMPDIR read-only: the run still measures (exit 0)",
            _run(),
            setup=S(_train(), lambda ctx: _ro(ctx, "tmp")),
            code=(0, 2),
            heavy=True,
        ),
        case(
            "run/concurrent-same-out",
            R,
            "concurrent",
            "two runs into one --out at once: each exits 0 or refuses; the report left is whole; no temp files",
            _run(),
            setup=_train(),
            concurrent=_run(),
            code=(0, 2),
            check=json_at("out/report.json", lambda r: isinstance(r, dict), "no whole report"),
            heavy=True,
        ),
    ]
    # --- signals ---------------------------------------------------------------------------------------------
    cs += [
        case(
            "run/sigterm-timed",
            R,
            "signal",
            "SIGTERM in the timed window: exit 143, nothing left running",
            _run(mode="slow", steps=40),
            setup=_train(),
            signals=[Signal("out:warm-up done", SIGTERM)],
            code=143,
            heavy=True,
            ci=True,
        ),
        case(
            "run/sigterm-after-window",
            R,
            "signal",
            "SIGTERM after the window while the script trains on: exit 143, the report kept and marked interrupted",
            _run(mode="slow", steps=60),
            setup=_train(),
            signals=[Signal("out:report written", SIGTERM, delay=0.5)],
            code=143,
            check=json_at(
                "out/report.json",
                lambda r: "interrupted" in r and r["metrics"]["real_tokens_per_s"] > 0,
                "the measured report was not kept",
                LOSS,
            ),
            heavy=True,
        ),
        case(
            "run/sighup",
            R,
            "signal",
            "SIGHUP in the traced window: exit 129, nothing left",
            _run(mode="slow", steps=40),
            setup=_train(),
            signals=[Signal("out:timed window done", SIGHUP)],
            code=129,
            heavy=True,
        ),
        case(
            "run/ctrl-c-group",
            R,
            "signal",
            "Ctrl-C at the terminal (SIGINT to the process group): exit 130, nothing left",
            _run(mode="slow", steps=40),
            setup=_train(),
            signals=[Signal("out:warm-up done", SIGINT, to="group")],
            code=130,
            heavy=True,
        ),
        case(
            "run/sigint-ignoring-script",
            R,
            "signal",
            "SIGINT to run while the script ignores every signal: killed after the grace period, exit 130",
            _run(mode="ignore-signals", steps=200),
            setup=_train(),
            signals=[Signal("out:warm-up done", SIGINT)],
            code=130,
            timeout=60,
            heavy=True,
        ),
        case(
            "run/double-sigint",
            R,
            "signal",
            "two Ctrl-C 0.3 s apart on a script that ignores them: killed at once, exit 130",
            _run(mode="ignore-signals", steps=200),
            setup=_train(),
            signals=[Signal("out:warm-up done", SIGINT), Signal("t:0", SIGINT, delay=0.3)],
            code=130,
            check=_no_orphan_quickly(40),
            timeout=60,
            heavy=True,
        ),
        case(
            "run/sigterm-before-script",
            R,
            "signal",
            "SIGTERM 0.3 s after start, before the script runs: exit 143 (or killed by it, -15, while Python "
            "starts), nothing left",
            _run(mode="slow"),
            setup=_train(),
            signals=[Signal("t:0.3", SIGTERM)],
            code=(143, -15),
            heavy=True,
            aims=LEAK,
        ),
        case(
            "run/sigterm-at-import",
            R,
            "signal",
            "SIGTERM as the script starts importing torch: exit 143, nothing left",
            _run(mode="slow"),
            setup=_train(),
            signals=[Signal("file:STARTED", SIGTERM)],
            code=143,
            heavy=True,
            aims=LEAK,
        ),
        case(
            "run/kill-script",
            R,
            "signal",
            "the script is killed (SIGKILL) in the timed window: run exits 1 saying so, nothing left",
            _run(mode="slow", steps=40),
            setup=_train(),
            signals=[Signal("out:warm-up done", SIGKILL, to="child:train.py")],
            code=1,
            heavy=True,
        ),
        case(
            "run/kill-parent",
            R,
            "signal",
            "vlmdoctor itself is killed (SIGKILL, as the OOM killer does): the script it started does not run on "
            "orphaned",
            _run(mode="quiet-slow", steps=80),
            setup=_train(),
            signals=[Signal("out:warm-up done", SIGKILL)],
            code=-9,
            heavy=True,
        ),
    ]
    return cs


def _ro(ctx: Ctx, rel: str) -> None:
    if rel == "tmp":
        ctx.tmpfs("tmp", "1m", ro=True)


def _tmp_full(ctx: Ctx) -> None:
    where = ctx.tmpfs("tmp", "256k")
    ctx.fill(where)
    # the filler is the probe's own: it is not a leak of the command
    ctx.notes["ballast"] = where / ".ballast"


# --- profile ------------------------------------------------------------------------------------------------


def _measured(rel: str = "r.json"):
    return json_at(
        rel, lambda r: (r.get("metrics") or {}).get("real_tokens_per_s", 0) > 0, "the measured numbers were lost", LOSS
    )


def profile_cases() -> list[Case]:
    P = "profile"
    cfg = ["profile", "--config", "c.yaml"]
    cs = []
    for cid, text in [
        ("config-list", "- model: tiny\n"),
        ("config-batch-string", "model: tiny\ndevice: cpu\nbatch_size: '4'\n"),
        ("config-steps-float", "model: tiny\ndevice: cpu\nsteps: 1.5\n"),
        ("config-steps-huge", "model: tiny\ndevice: cpu\nsteps: 1000000000000000000000000000000\n"),
        ("config-model-list", "model: [tiny]\ndevice: cpu\n"),
        ("config-unknown-knob", "model: tiny\ndevice: cpu\nbatch_sise: 8\n"),
        ("config-python-tag", "model: !!python/object/apply:os.system ['touch PWNED']\n"),
        ("config-lr-nan", "model: tiny\ndevice: cpu\nlr: .nan\n"),
        ("config-lr-inf", "model: tiny\ndevice: cpu\nlr: .inf\n"),
        ("config-bool-steps", "model: tiny\ndevice: cpu\nsteps: true\n"),
        ("config-null-model", "model: null\ndevice: cpu\n"),
        ("config-date", "model: tiny\ndevice: cpu\nseed: 2026-11-27\n"),
        ("config-hostile-model", f"model: {json.dumps(HOSTILE)}\ndevice: cpu\n"),
        ("config-binary", "\x00\x01\x02model: tiny\n"),
    ]:
        cs.append(
            case(
                f"profile/{cid}",
                P,
                "wrong-type",
                f"--config with {cid}: one line naming the knob or file, exit 2",
                cfg,
                setup=put("c.yaml", text),
                hostile_text=cid == "config-hostile-model",
                ci=cid == "config-steps-float",
            )
        )
    cs += [
        case(
            "profile/config-fifo", P, "fifo", "--config a fifo: exit 2 at once", cfg, setup=fifo("c.yaml"), timeout=30
        ),
        case(
            "profile/config-dev-zero",
            P,
            "special",
            "--config a link to /dev/zero: exit 2",
            cfg,
            setup=link("c.yaml", "/dev/zero"),
            timeout=30,
        ),
        case("profile/config-folder", P, "wrong-type", "--config a folder: exit 2", cfg, setup=mkdir("c.yaml")),
        case(
            "profile/config-report-future",
            P,
            "wrong-type",
            "a report of schema_version 999 as --config: exit 2",
            ["profile", "--config", "r.json"],
            setup=put_report("r.json", lambda r: r.__setitem__("schema_version", 999)),
        ),
        case(
            "profile/config-report-config-string",
            P,
            "wrong-type",
            "a report whose config is a string as --config: exit 2",
            ["profile", "--config", "r.json"],
            setup=put_report("r.json", lambda r: r.__setitem__("config", "tiny")),
        ),
        case(
            "profile/config-json-huge-number",
            P,
            "huge",
            "a JSON config of a 5,000-digit batch size: exit 2",
            ["profile", "--config", "c.json"],
            setup=put("c.json", '{"model": "tiny", "batch_size": ' + "9" * 5000 + "}"),
        ),
        case(
            "profile/save-config-link",
            P,
            "symlink",
            "--save-config a link to a file outside, --force: exit 2, unchanged",
            ["profile", *FAST, "--save-config", "s.yaml", "--force"],
            setup=link("s.yaml", "{outside}/secret.txt"),
        ),
        case(
            "profile/save-config-read-only",
            P,
            "read-only",
            "--save-config into a read-only mount: exit 2 before the run",
            ["profile", *FAST, "--save-config", "ro/s.yaml"],
            setup=readonly("ro"),
        ),
        case(
            "profile/json-save-config-same",
            P,
            "output",
            "--json and --save-config the same file: exit 2",
            ["profile", *FAST, "--json", "x", "--save-config", "x"],
        ),
        case(
            "profile/trace-dir-file",
            P,
            "wrong-type",
            "--trace-dir names a file: exit 2",
            ["profile", *FAST, "--trace-dir", "td"],
            setup=put("td", "mine"),
        ),
        case(
            "profile/trace-dir-link",
            P,
            "symlink",
            "--trace-dir a link to a folder outside: exit 2, nothing written outside",
            ["profile", *FAST, "--trace-dir", "td"],
            setup=link("td", "{outside}"),
        ),
        case(
            "profile/trace-dir-read-only",
            P,
            "read-only",
            "--trace-dir a read-only mount: exit 2 before the run",
            ["profile", *FAST, "--trace-dir", "ro"],
            setup=readonly("ro"),
        ),
        case(
            "profile/trace-dir-full",
            P,
            "full-disk",
            "--trace-dir a full disk: exit 2 before the run",
            ["profile", *FAST, "--trace-dir", "full"],
            setup=full("full"),
            ci=False,
        ),
    ]
    for cid, flags in [
        ("steps-zero", ["--steps", "0"]),
        ("lr-nan", ["--lr", "nan"]),
        ("batch-zero", ["--batch-size", "0"]),
        ("num-samples-negative", ["--num-samples", "-1"]),
        ("trace-steps-zero", ["--trace-steps", "0"]),
        ("steps-huge", ["--steps", str(10**15)]),
        ("pack-length-zero", ["--packing", "--pack-length", "0"]),
        ("model-empty", ["--model", ""]),
        ("device-tpu", ["--device", "tpu"]),
        ("device-cuda", ["--device", "cuda"]),
        ("gpu-preset-auto", ["--model", "0.5b", "--device", "auto"]),
        ("lora-rank-zero", ["--train", "lora", "--lora-rank", "0"]),
        ("dpo-beta-inf", ["--objective", "dpo", "--dpo-beta", "inf"]),
        ("grad-accum-zero", ["--grad-accum", "0"]),
        ("num-workers-negative", ["--num-workers", "-1"]),
        ("nproc-zero", ["--nproc-per-node", "0"]),
        ("ddp-one-proc", ["--parallel", "ddp", "--nproc-per-node", "1", "--master-port", "99999"]),
        ("seed-huge", ["--seed", str(2**70)]),
        ("warmup-huge", ["--warmup", str(10**12)]),
        ("repeats-zero", ["--repeats", "0"]),
    ]:
        base = (
            ["--model", "tiny", "--device", "cpu"]
            if cid not in ("model-empty", "device-tpu", "device-cuda", "gpu-preset-auto")
            else []
        )
        cs.append(
            case(
                f"profile/{cid}",
                P,
                "bad-value",
                f"{' '.join(flags)}: exit 2 naming the flag, before any run",
                ["profile", *base, *flags],
                timeout=60,
            )
        )
    D = [
        "profile",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--no-diagnose",
        "--tokenizer",
        "tok",
    ]
    cs += [
        case(
            "profile/data-fifo",
            P,
            "fifo",
            "--data a fifo: exit 2 at once",
            [*D, "--data", "d.jsonl"],
            setup=S(_tok(), fifo("d.jsonl")),
            timeout=60,
        ),
        case(
            "profile/data-dev-zero",
            P,
            "special",
            "--data a link to /dev/zero: exit 2",
            [*D, "--data", "d.jsonl"],
            setup=S(_tok(), link("d.jsonl", "/dev/zero")),
            timeout=60,
        ),
        case(
            "profile/data-image-dev-zero",
            P,
            "special",
            "a record whose image is /dev/zero: a bad record (exit 2 with its line), no hang",
            [*D, "--data", "d.jsonl"],
            setup=S(_tok(), _data("/dev/zero")),
            timeout=90,
            heavy=True,
        ),
        case(
            "profile/data-image-fifo",
            P,
            "fifo",
            "a record whose image is a fifo: a bad record, no hang",
            [*D, "--data", "d.jsonl"],
            setup=S(_tok(), fifo("img.png"), _data("img.png")),
            timeout=90,
            heavy=True,
        ),
        case(
            "profile/data-image-bomb",
            P,
            "huge",
            "a record whose PNG claims 40000x40000 pixels: a bad record, memory bounded",
            [*D, "--data", "d.jsonl"],
            setup=S(_tok(), _png_bomb("img.png"), _data("img.png")),
            timeout=90,
            heavy=True,
        ),
        case(
            "profile/data-image-folder",
            P,
            "wrong-type",
            "a record whose image is a folder: a bad record, exit 2",
            [*D, "--data", "d.jsonl"],
            setup=S(_tok(), mkdir("img.png"), _data("img.png")),
            timeout=90,
            heavy=True,
        ),
        case(
            "profile/data-line-garbage",
            P,
            "wrong-type",
            "--data whose first line is 5 MB of binary: exit 2 naming line 1",
            [*D, "--data", "d.jsonl"],
            setup=S(_tok(), put("d.jsonl", lambda: bytes(range(256)) * 20_000 + b"\n")),
            needles=("line 1",),
            timeout=60,
            heavy=True,
        ),
        case(
            "profile/tokenizer-fifo",
            P,
            "fifo",
            "--tokenizer a folder whose tokenizer.json is a fifo: exit 2, no hang",
            [*D, "--data", "d.jsonl"],
            setup=S(fifo("tok/tokenizer.json"), put("tok/tokenizer_config.json", "{}"), _data("x.png")),
            timeout=60,
            heavy=True,
        ),
    ]
    # --- real runs -------------------------------------------------------------------------------------------
    F = ["profile", "--model", "tiny", "--device", "cpu", "--steps", "3", "--warmup", "1"]
    cs += [
        case(
            "profile/sigint-build",
            P,
            "signal",
            "Ctrl-C while the model is built: exit 130, nothing left",
            [*F, "--json", "r.json"],
            signals=[Signal("out:building model", SIGINT, delay=0.5)],
            env=PROGRESS,
            code=130,
            heavy=True,
            ci=False,
        ),
        case(
            "profile/sigterm-timed",
            P,
            "signal",
            "SIGTERM in the timed window: exit 143, nothing left",
            [*F, "--steps", "30", "--json", "r.json"],
            signals=[Signal("out:timed 1/1", SIGTERM, delay=0.5)],
            env=PROGRESS,
            code=143,
            heavy=True,
            aims=LEAK,
        ),
        case(
            "profile/sighup-timed",
            P,
            "signal",
            "SIGHUP in the timed window: exit 129",
            [*F, "--steps", "30", "--json", "r.json"],
            signals=[Signal("out:timed 1/1", SIGHUP, delay=0.5)],
            env=PROGRESS,
            code=129,
            heavy=True,
        ),
        case(
            "profile/double-sigint",
            P,
            "signal",
            "two Ctrl-C 0.2 s apart: exit 130, nothing left",
            [*F, "--steps", "30"],
            signals=[
                Signal("out:timed 1/1", SIGINT, to="group", delay=0.3),
                Signal("t:0", SIGINT, to="group", delay=0.2),
            ],
            env=PROGRESS,
            code=(130, -2),  # the second Ctrl-C may end Python itself (killed by SIGINT: the shell shows 130)
            heavy=True,
        ),
        case(
            "profile/sigterm-traced",
            P,
            "signal",
            "SIGTERM in the traced window or the diagnosis: exit 143, the timed numbers kept in --json",
            [*F, "--steps", "4", "--trace-steps", "4", "--json", "r.json"],
            signals=[Signal("out:traced steps", SIGTERM, delay=0.3)],
            env=PROGRESS,
            code=143,
            check=_measured(),
            heavy=True,
        ),
        case(
            "profile/tmp-full",
            P,
            "full-disk",
            "TMPDIR full (the diagnosis trace goes there): refused up front (2) or the measurement kept with a note",
            [*F, "--json", "r.json"],
            setup=_tmp_full,
            code=(0, 1, 2),
            check=lambda ctx, obs: [] if obs.rc == 2 else _measured()(ctx, obs),
            heavy=True,
        ),
        case(
            "profile/tmp-read-only",
            P,
            "read-only",
            "TMPDIR read-only: refused up front (2) or the measurement kept with a note",
            [*F, "--json", "r.json"],
            setup=lambda ctx: _ro(ctx, "tmp"),
            code=(0, 1, 2),
            check=lambda ctx, obs: [] if obs.rc == 2 else _measured()(ctx, obs),
            heavy=True,
        ),
        case(
            "profile/json-full",
            P,
            "full-disk",
            "--json onto a full disk: the report rescued and named, exit 1",
            [*F, "--no-diagnose", "--json", "full/r.json"],
            setup=full("full"),
            code=1,
            check=rescued_or_written("full/r.json"),
            heavy=True,
        ),
        case(
            "profile/trace-dir-fills",
            P,
            "full-disk",
            "--trace-dir on a disk that fills during the run: the measurement kept in --json, exit 1 naming the "
            "lost trace",
            [*F, "--trace-dir", "td", "--json", "r.json", "--save-config", "s.yaml"],
            setup=small_disk("td", "17m"),
            concurrent=[
                "python",
                "-c",
                "import os, time\nwhile not os.path.exists('s.yaml'): time.sleep(0.05)\nf = open('td/ballast', 'wb')\n"
                "try:\n    [f.write(b'0' * 65536) for _ in iter(int, 1)]\nexcept OSError: pass",
            ],
            code=(0, 1),
            may_change=("work/td/*",),
            check=_measured(),
            heavy=True,
        ),
        case(
            "profile/concurrent-json-no-force",
            P,
            "concurrent",
            "two profiles to one new --json at once without --force: one writes; the other must not replace it "
            "silently",
            [*F, "--no-diagnose", "--json", "r.json"],
            concurrent=[*F, "--no-diagnose", "--json", "r.json"],
            code=(0, 1),
            check=lambda ctx, obs: _one_writer(obs),
            heavy=True,
        ),
        case(
            "profile/ddp-ctrl-c",
            P,
            "signal",
            "Ctrl-C to the group of a 2-rank CPU DDP run (torchrun): exit 130, no rank left",
            [*F, "--nproc-per-node", "2", "--parallel", "ddp", "--no-diagnose", "--steps", "40"],
            signals=[Signal("proc:vlmdoctor", SIGINT, to="group", delay=6)],
            code=130,
            timeout=150,
            heavy=True,
        ),
        case(
            "profile/ddp-kill-rank",
            P,
            "signal",
            "one rank of a 2-rank CPU DDP run killed: profile ends with one line (exit 1), no rank left",
            [*F, "--nproc-per-node", "2", "--parallel", "ddp", "--no-diagnose", "--steps", "40"],
            signals=[Signal("proc:rank_worker", SIGKILL, to="one:rank_worker", delay=8)],
            code=(1, 2),
            timeout=150,
            heavy=True,
        ),
        case(
            "profile/ddp-kill-parent",
            P,
            "signal",
            "vlmdoctor killed (SIGKILL) during a 2-rank DDP run: torchrun and the ranks do not run on orphaned; "
            "the temp folder it could not remove is removed by the next vlmdoctor run",
            [*F, "--nproc-per-node", "2", "--parallel", "ddp", "--no-diagnose", "--steps", "60"],
            signals=[Signal("proc:torch.distributed.run", SIGKILL, delay=6)],
            code=-9,
            temp_ok=("vlmdoctor-ranks-*",),
            check=_swept_by_next_run,
            timeout=150,
            heavy=True,
        ),
    ]
    return cs


def _swept_by_next_run(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    """A vlmdoctor killed outright cannot remove its temp folder: the next run must (supervise.sweep_stale)."""
    left = [t for t in obs.temp_left if Path(t).parts[0].startswith("vlmdoctor-ranks-")]
    if not left:
        return []
    env = {**os.environ, "TMPDIR": str(ctx.tmp)}
    subprocess.run(
        [sys.executable, "-c", "from vlmdoctor.cli import main; main()", "profile", *FAST, "--json", "next.json"],
        cwd=ctx.work,
        env=env,
        capture_output=True,
        timeout=120,
    )
    still = [t for t in left if (ctx.tmp / t).exists()]
    return [(LEAK, f"the next vlmdoctor run left it too: {', '.join(still[:3])}")] if still else []


def _one_writer(obs: Obs) -> list[tuple[str, str]]:
    codes = sorted([obs.rc, (obs.second or {}).get("exit_code")])
    if codes == [0, 0]:
        return [(LOSS, "both wrote one new file without --force: the first one's output was replaced")]
    return []


def _tok():
    """A tiny local tokenizer folder (tokenizers' BPE), as tests/conftest.py builds one."""

    def step(ctx: Ctx) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(["what is in the picture? a cat on a mat."] * 20, trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<|endoftext|>", additional_special_tokens=special[1:]
        )
        fast.save_pretrained(ctx.work / "tok")

    return step


def _data(image: str, n: int = 8):
    def step(ctx: Ctx) -> None:
        rec = {
            "image": image,
            "conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}],
        }
        (ctx.work / "d.jsonl").write_text("\n".join(json.dumps(rec) for _ in range(n)) + "\n")

    return step


def _png_bomb(rel: str):
    """A small PNG whose header claims 40000 x 40000 pixels (a decompression bomb)."""

    def step(ctx: Ctx) -> None:
        import struct
        import zlib

        w = h = 40_000

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        raw = zlib.compressobj(9)
        row = b"\x00" + b"\x00" * (w * 3)
        body = b"".join(raw.compress(row) for _ in range(200)) + raw.flush()
        png = (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", body)
            + chunk(b"IEND", b"")
        )
        (ctx.work / rel).write_bytes(png)

    return step


# --- sweep ---------------------------------------------------------------------------------------------------


def _rows(rel: str, n: int):
    return json_at(rel, lambda v: len(v["runs"]) >= n, f"fewer than {n} finished row(s) kept", LOSS)


def sweep_cases() -> list[Case]:
    SW = "sweep"
    G = ["sweep", "g.yaml"]
    cs = []
    for cid, text in [
        ("runs-string", "runs: x\n"),
        ("runs-numbers", "runs: [1, 2]\n"),
        ("defaults-list", "defaults: [model, tiny]\nruns: [{name: a}]\n"),
        ("name-mapping", "defaults: {model: tiny, device: cpu}\nruns: [{name: {a: 1}}]\n"),
        ("stages-string", "defaults: {model: tiny, device: cpu}\nstages: '2'\nruns: [{name: a}]\n"),
        ("knob-wrong-type", "defaults: {model: tiny, device: cpu, batch_size: x}\nruns: [{name: a}]\n"),
        ("top-unknown", "defaults: {model: tiny, device: cpu}\nrun: [{name: a}]\n"),
        ("set-list", "defaults: {model: tiny, device: cpu}\nruns: [{name: a, set: [1, 2]}]\n"),
        ("empty", ""),
        ("gpu-row", "defaults: {device: cuda}\nruns: [{name: a}]\n"),
    ]:
        cs.append(
            case(
                f"sweep/{cid}",
                SW,
                "wrong-type",
                f"a grid with {cid}: exit 2 before any run",
                G,
                setup=put("g.yaml", text),
            )
        )
    SET = ["sweep", "--set", "model=tiny", "--set", "device=cpu"]
    cs += [
        case("sweep/grid-fifo", SW, "fifo", "the grid is a fifo: exit 2 at once", G, setup=fifo("g.yaml"), timeout=30),
        case(
            "sweep/set-trailing-comma",
            SW,
            "bad-value",
            "--set steps=1,2, (an empty value): exit 2",
            [*SET, "--set", "steps=1,2,"],
        ),
        case("sweep/set-inf", SW, "bad-value", "--set batch_size=1e999: exit 2", [*SET, "--set", "batch_size=1e999"]),
        case(
            "sweep/set-anchor",
            SW,
            "code-injection",
            "--set a YAML anchor/alias value: exit 2",
            [*SET, "--set", "lr=&a 1"],
        ),
        case(
            "sweep/set-python-tag",
            SW,
            "code-injection",
            "--set a !!python tag: exit 2, nothing runs",
            [*SET, "--set", "seed=!!python/object/apply:os.system ['touch PWNED']"],
        ),
        case(
            "sweep/csv-link",
            SW,
            "symlink",
            "--csv a link to a file outside, --force: exit 2",
            [*SET, "--csv", "t.csv", "--force"],
            setup=link("t.csv", "{outside}/secret.txt"),
        ),
        case(
            "sweep/jsonl-fifo",
            SW,
            "fifo",
            "--jsonl a fifo: exit 2 at once",
            [*SET, "--jsonl", "r.jsonl"],
            setup=fifo("r.jsonl"),
            timeout=30,
        ),
        case(
            "sweep/csv-read-only",
            SW,
            "read-only",
            "--csv into a read-only mount: exit 2 before any run",
            [*SET, "--csv", "ro/t.csv"],
            setup=readonly("ro"),
        ),
        case(
            "sweep/tmp-read-only",
            SW,
            "read-only",
            "TMPDIR read-only: exit 2 before any run, or the runs go to the next temp folder (Python's fallback)",
            [*SET, "--set", "steps=1", "--set", "warmup=0"],
            setup=lambda ctx: _ro(ctx, "tmp"),
            code=(0, 2),
            heavy=True,
        ),
        case(
            "sweep/tmp-full",
            SW,
            "full-disk",
            "TMPDIR full: exit 2 before any run, or the runs go to the next temp folder",
            [*SET, "--set", "steps=1", "--set", "warmup=0"],
            setup=_tmp_full,
            code=(0, 2),
            heavy=True,
        ),
        case("sweep/timeout-zero", SW, "bad-value", "--timeout 0: exit 2", [*SET, "--timeout", "0"]),
        case("sweep/timeout-nan", SW, "bad-value", "--timeout nan: exit 2", [*SET, "--timeout", "nan"]),
    ]
    TWO = (
        "defaults: {model: tiny, device: cpu, steps: 2, warmup: 1}\n"
        "runs:\n  - name: first\n  - name: second\n    set: {steps: 40}\n"
    )
    cs += [
        case(
            "sweep/sigterm-second-run",
            SW,
            "signal",
            "SIGTERM during the second run: exit 143, the first row kept in --csv and --json, nothing left",
            [*G, "--csv", "t.csv", "--json", "t.json", "--jsonl", "r.jsonl"],
            setup=put("g.yaml", TWO),
            signals=[Signal("file:r.jsonl", SIGTERM, delay=3)],
            code=143,
            check=_both(
                _rows("t.json", 1),
                lambda ctx, obs: (
                    [] if "first" in (ctx.work / "t.csv").read_text() else [(LOSS, "the CSV lost the first row")]
                ),
            ),
            timeout=240,
            heavy=True,
        ),
        case(
            "sweep/ctrl-c-group",
            SW,
            "signal",
            "Ctrl-C at the terminal during the second run: exit 130, the first row kept, nothing left",
            [*G, "--json", "t.json", "--jsonl", "r.jsonl"],
            setup=put("g.yaml", TWO),
            signals=[Signal("file:r.jsonl", SIGINT, to="group", delay=3)],
            code=130,
            check=_rows("t.json", 1),
            timeout=240,
            heavy=True,
        ),
        case(
            "sweep/run-timeout",
            SW,
            "hang",
            "--timeout 4 on a run of 200 steps: the row says timeout, nothing left, the sweep ends",
            [
                "sweep",
                "--set",
                "model=tiny",
                "--set",
                "device=cpu",
                "--set",
                "steps=200",
                "--timeout",
                "4",
                "--json",
                "t.json",
            ],
            code=(0, 1),
            check=json_at("t.json", lambda v: v["runs"][0]["status"] == "timeout", "the row does not say timeout"),
            timeout=120,
            heavy=True,
            aims=LEAK,
        ),
        case(
            "sweep/hostile-names",
            SW,
            "hostile-string",
            "run names with escapes and spreadsheet formulas: the console escaped, the CSV cells neutralised",
            [*G, "--csv", "t.csv"],
            setup=put(
                "g.yaml",
                "defaults: {model: tiny, device: cpu, steps: 1, warmup: 0}\nruns:\n  - name: "
                + json.dumps("@SUM(1+1)*cmd|' /C calc'!A0" + HOSTILE)
                + "\n",
            ),
            code=0,
            hostile_text=True,
            check=lambda ctx, obs: (
                []
                if "\n@" not in (ctx.work / "t.csv").read_text() and ",@" not in (ctx.work / "t.csv").read_text()
                else [("security defect", "a formula cell in the CSV")]
            ),
            timeout=180,
            heavy=True,
        ),
        case(
            "sweep/kill-child",
            SW,
            "signal",
            "the run's process is killed (SIGKILL, as the OOM killer does): the row says error, the sweep ends, "
            "nothing left",
            ["sweep", "--set", "model=tiny", "--set", "device=cpu", "--set", "steps=200", "--json", "t.json"],
            signals=[Signal("proc:vlmdoctor profile", SIGKILL, to="child:vlmdoctor profile", delay=8)],
            code=(0, 1),
            check=json_at("t.json", lambda v: v["runs"][0]["status"] != "ok", "the killed run is not marked"),
            timeout=180,
            heavy=True,
        ),
    ]
    return cs


# --- treat -------------------------------------------------------------------------------------------------


def treat_cases() -> list[Case]:
    TR = "treat"
    T = ["treat", "--model", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    cs = [
        case(
            "treat/out-file", TR, "wrong-type", "--out names a file: exit 2", [*T, "--out", "o"], setup=put("o", "mine")
        ),
        case(
            "treat/out-link",
            TR,
            "symlink",
            "--out a link to a folder outside, --force: exit 2, nothing outside",
            [*T, "--out", "o", "--force"],
            setup=link("o", "{outside}"),
        ),
        case(
            "treat/out-read-only",
            TR,
            "read-only",
            "--out a read-only mount: exit 2",
            [*T, "--out", "ro"],
            setup=readonly("ro"),
        ),
        case(
            "treat/out-not-empty",
            TR,
            "output",
            "--out holds the user's files: exit 2 without --force, unchanged",
            [*T, "--out", "o"],
            setup=put("o/notes.txt", "mine"),
        ),
        case(
            "treat/out-treat-json-link",
            TR,
            "symlink",
            "--out/treat.json a link outside, --force: exit 2",
            [*T, "--out", "o", "--force"],
            setup=S(mkdir("o"), link("o/treat.json", "{outside}/secret.txt")),
        ),
        case(
            "treat/config-fifo",
            TR,
            "fifo",
            "--config a fifo: exit 2 at once",
            ["treat", "--config", "c.yaml"],
            setup=fifo("c.yaml"),
            timeout=30,
        ),
        case("treat/max-pairs-two", TR, "bad-value", "--max-pairs 2: exit 2", [*T, "--max-pairs", "2"]),
        case("treat/min-gain-nan", TR, "bad-value", "--min-gain nan: exit 2", [*T, "--min-gain", "nan"]),
        case("treat/time-budget-negative", TR, "bad-value", "--time-budget -1: exit 2", [*T, "--time-budget", "-1"]),
        case("treat/set-unknown", TR, "bad-value", "--set bogus=1: exit 2", [*T, "--set", "bogus=1"], ci=False),
        case(
            "treat/sigterm-trial",
            TR,
            "signal",
            "SIGTERM during a trial: exit 143, nothing left, the trials so far written to --out",
            [*T, "--out", "o", "--max-pairs", "3"],
            signals=[Signal("proc:vlmdoctor profile", SIGTERM, delay=4)],
            code=143,
            creates=("work/o/treat.json",),
            timeout=300,
            heavy=True,
        ),
        case(
            "treat/ctrl-c-group",
            TR,
            "signal",
            "Ctrl-C at the terminal during a trial: exit 130, nothing left",
            [*T, "--out", "o", "--max-pairs", "3"],
            signals=[Signal("proc:vlmdoctor profile", SIGINT, to="group", delay=4)],
            code=130,
            timeout=300,
            heavy=True,
        ),
    ]
    return cs


# --- gate ---------------------------------------------------------------------------------------------------


def gate_cases() -> list[Case]:
    GA = "gate"
    BC = ["gate", "--baseline", "b.json", "--current", "c.json"]
    both = S(put_report("b.json"), put_report("c.json"))
    cs = [
        case(
            "gate/baseline-fifo",
            GA,
            "fifo",
            "the baseline a fifo: exit 2 at once",
            BC,
            setup=S(fifo("b.json"), put_report("c.json")),
            timeout=30,
        ),
        case(
            "gate/baseline-folder",
            GA,
            "wrong-type",
            "the baseline a folder: exit 2",
            BC,
            setup=S(mkdir("b.json"), put_report("c.json")),
        ),
        case(
            "gate/update-link-outside",
            GA,
            "symlink",
            "--update-baseline onto a link to a file outside: exit 2, unchanged",
            [*BC, "--update-baseline"],
            setup=S(
                link("b.json", "{outside}/base.json"),
                lambda ctx: (ctx.outside / "base.json").write_text(REPORT.read_text()),
                put_report("c.json"),
            ),
        ),
        case(
            "gate/update-read-only",
            GA,
            "read-only",
            "--update-baseline on a read-only mount: exit 2, unchanged",
            ["gate", "--baseline", "ro/b.json", "--current", "c.json", "--update-baseline"],
            setup=S(readonly("ro", put_report("ro/b.json")), put_report("c.json")),
        ),
        case(
            "gate/update-full",
            GA,
            "full-disk",
            "--update-baseline onto a full disk: refused up front (exit 2), the old baseline whole",
            ["gate", "--baseline", "full/b.json", "--current", "c.json", "--update-baseline"],
            setup=S(full("full", then=put_report("full/b.json")), put_report("c.json")),
            needles=("free",),
        ),
        case(
            "gate/junit-is-baseline",
            GA,
            "output",
            "--junit ./b.json --force: refused, the baseline unchanged",
            [*BC, "--junit", "./b.json", "--force"],
            setup=both,
            ci=True,
        ),
        case(
            "gate/summary-fifo",
            GA,
            "fifo",
            "GITHUB_STEP_SUMMARY a fifo: a warning, no hang, the verdict stands (exit 0)",
            BC,
            setup=S(both, fifo("summary.md")),
            env={"GITHUB_STEP_SUMMARY": "{work}/summary.md"},
            code=0,
            timeout=30,
        ),
        case(
            "gate/summary-is-baseline",
            GA,
            "output",
            "GITHUB_STEP_SUMMARY names the baseline: a warning, the baseline unchanged, exit 0",
            BC,
            setup=both,
            env={"GITHUB_STEP_SUMMARY": "{work}/b.json"},
            code=0,
        ),
        case(
            "gate/summary-link-outside",
            GA,
            "symlink",
            "GITHUB_STEP_SUMMARY a dangling link outside: a warning, nothing written outside",
            BC,
            setup=S(both, link("summary.md", "{outside}/summary.md")),
            env={"GITHUB_STEP_SUMMARY": "{work}/summary.md"},
            code=0,
        ),
        case(
            "gate/max-regression-nan",
            GA,
            "bad-value",
            "--max-regression nan: exit 2",
            [*BC, "--max-regression", "nan"],
            setup=both,
        ),
        case(
            "gate/max-regression-negative",
            GA,
            "bad-value",
            "--max-regression -0.1: exit 2",
            [*BC, "--max-regression", "-0.1"],
            setup=both,
        ),
        case("gate/alpha-one", GA, "bad-value", "--alpha 1: exit 2", [*BC, "--alpha", "1"], setup=both),
        case(
            "gate/fail-on-critical",
            GA,
            "bad-value",
            "--fail-on critical: exit 2",
            [*BC, "--fail-on", "critical"],
            setup=both,
        ),
        case(
            "gate/current-tokens-zero",
            GA,
            "wrong-type",
            "a current report of 0 tokens/s: a verdict or a refusal, never an internal error",
            BC,
            setup=S(
                put_report("b.json"), put_report("c.json", lambda r: r["metrics"].__setitem__("real_tokens_per_s", 0))
            ),
            code=(0, 1, 2),
        ),
        case(
            "gate/repeats-strings",
            GA,
            "wrong-type",
            "repeats holding strings in the current report: exit 2",
            BC,
            setup=S(put_report("b.json"), put_report("c.json", lambda r: r.__setitem__("repeats", ["fast"] * 3))),
        ),
        case(
            "gate/step-times-strings",
            GA,
            "wrong-type",
            "per-step times as strings: exit 2",
            BC,
            setup=S(put_report("b.json"), put_report("c.json", lambda r: _steps_to(r, "x"))),
        ),
        case(
            "gate/huge-repeats",
            GA,
            "huge",
            "200,000 per-step samples: a verdict in bounded time",
            BC,
            setup=S(put_report("b.json"), put_report("c.json", lambda r: _many_steps(r, 200_000))),
            code=(0, 1, 2),
            timeout=60,
        ),
        case(
            "gate/hostile-findings",
            GA,
            "hostile-string",
            "findings whose titles hold escapes and a Rich [link=]: the verdict printed escaped",
            BC,
            setup=S(put_report("b.json", _hostile_findings), put_report("c.json", _hostile_findings)),
            code=(0, 1, 2),
            hostile_text=True,
        ),
        case(
            "gate/junit-full",
            GA,
            "full-disk",
            "--junit onto a full disk: refused up front, exit 2",
            [*BC, "--junit", "full/j.xml"],
            setup=S(both, full("full")),
            needles=("free",),
        ),
        case(
            "gate/current-command-unterminated",
            GA,
            "bad-value",
            "--current-command with an open quote: exit 2",
            ["gate", "--baseline", "b.json", "--remeasure-baseline", "--current-command", "'python train.py"],
            setup=put_report("b.json"),
        ),
        case(
            "gate/max-pairs-two",
            GA,
            "bad-value",
            "--remeasure-baseline --max-pairs 2: exit 2",
            ["gate", "--baseline", "b.json", "--remeasure-baseline", "--max-pairs", "2"],
            setup=put_report("b.json"),
        ),
        case(
            "gate/gpu-baseline-no-current",
            GA,
            "bad-value",
            "no --current with a baseline measured on a GPU, on a machine without one: exit 2 before any run",
            ["gate", "--baseline", "b.json"],
            setup=put_report("b.json"),
            timeout=60,
        ),
        case(
            "gate/tmp-read-only-no-current",
            GA,
            "read-only",
            "no --current, TMPDIR read-only: exit 2 before any run",
            ["gate", "--baseline", "b.json"],
            setup=S(put_report("b.json"), lambda ctx: _ro(ctx, "tmp")),
        ),
    ]
    cs += [
        case(
            "gate/sigterm-child-run",
            GA,
            "signal",
            "no --current: SIGTERM while the baseline's config runs: exit 143, nothing left",
            ["gate", "--baseline", "b.json", "--timeout", "200"],
            setup=_tiny_baseline,
            signals=[Signal("proc:vlmdoctor profile", SIGTERM, delay=3)],
            code=143,
            timeout=200,
            heavy=True,
        ),
        case(
            "gate/remeasure-ctrl-c",
            GA,
            "signal",
            "--remeasure-baseline of a script baseline: Ctrl-C at the terminal mid-pairs: exit 130, nothing left",
            ["gate", "--baseline", "b.json", "--remeasure-baseline", "--max-pairs", "3"],
            setup=_script_baseline,
            signals=[Signal("proc:train.py", SIGINT, to="group", delay=2)],
            code=130,
            timeout=240,
            heavy=True,
        ),
    ]
    return cs


def _steps_to(r: dict, value) -> None:
    for rep in r.get("repeats") or []:
        for k, v in list(rep.items()):
            if isinstance(v, list):
                rep[k] = [value] * len(v)


def _many_steps(r: dict, n: int) -> None:
    for rep in r.get("repeats") or []:
        for k, v in list(rep.items()):
            if isinstance(v, list) and v and isinstance(v[0], (int, float)):
                rep[k] = (v * (n // len(v) + 1))[:n]


def _hostile_findings(r: dict) -> None:
    r["findings"] = [
        {
            "id": "fusion-eager-attention",
            "title": HOSTILE + "[link=file:///etc/passwd]x[/link]",
            "severity": "high",
            "layer": 4,
        }
    ]


def _tiny_baseline(ctx: Ctx) -> None:
    """A baseline of the tiny preset on this CPU, as `profile` writes it (the config is what the gate re-runs)."""
    r = json.loads(REPORT.read_text())
    r["config"].update(model="tiny", device="cpu", steps=200, warmup=1, batch_size=2, autocast="off")
    r["env"] = {**(r.get("env") or {}), "device_type": "cpu", "gpu": None}
    (ctx.work / "b.json").write_text(json.dumps(r))


def _script_baseline(ctx: Ctx) -> None:
    """A baseline recorded by `vlmdoctor run` of the training script (the command the gate runs again)."""
    import sys

    (ctx.work / "train.py").write_text(TRAIN)
    r = json.loads(REPORT.read_text())
    r["script"] = {
        "command": ["python", "train.py", "slow", "200"],
        "cwd": str(ctx.work),
        "python": sys.executable,
        "env": {},
        "warmup": 1,
        "steps": 30,
    }
    r["env"] = {**(r.get("env") or {}), "device_type": "cpu", "gpu": None}
    r["config"].update(device="cpu", source="script")
    (ctx.work / "b.json").write_text(json.dumps(r))


def all_run_cases() -> list[Case]:
    return [*run_cases(), *profile_cases(), *sweep_cases(), *treat_cases(), *gate_cases()]


__all__ = ["ORPHAN", "Path", "all_run_cases"]
