"""Cases of the ways into the user's own process: `vlmdoctor.Doctor` in a loop and `DoctorCallback` in a Trainer.

Each case is a user's script: it trains a tiny model once without vlmdoctor (the reference losses), then
again with vlmdoctor as the case says, and prints USER-OK only when the second loop ended with the
reference's losses. Whatever vlmdoctor meets (a bad folder, a full disk, a hostile model, a second
profiler), the loop must end that way.
"""

from __future__ import annotations

import textwrap

from harness import LEAK, LOSS, SECURITY, Case, Ctx, Obs, Signal
from kit import HOSTILE, SIGINT, SIGTERM, S, case, fifo, full, json_at, link, put, readonly

LOOP = r"""
import json, os, sys, threading
import torch
from torch import nn
torch.set_num_threads(1)

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.llm = nn.Embedding(50, 16)
        self.projector = nn.Linear(16, 16)
    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"loss": self.projector(self.llm(input_ids)).pow(2).mean()}

def batch(i):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(1, 50, (4, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

def loop(n, each=None, on_model=None, make=Tiny):
    torch.manual_seed(0)
    model = make()
    if on_model is not None:
        on_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(n):
        b = batch(i)
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 6))
        if each is not None:
            each(i, model, b)
    return losses

N = int(os.environ.get("PROBE_N", "12"))
ref = loop(N)
import vlmdoctor
W = dict(warmup=1, steps=2, trace_steps=1)
"""

END = '\nprint("USER-OK" if got == ref else f"USER-DIFFERENT {got} {ref}", flush=True)\n'


def _script(body: str) -> str:
    return LOOP + body + END


def api(id: str, input: str, expect: str, body: str, setup=None, report: bool = True, **kw) -> Case:
    """A Doctor case: the script `LOOP + body` must print USER-OK; with `report`, out/report.json holds a
    measurement."""
    steps = [put("train.py", _script(body))]
    if setup is not None:
        steps.append(setup)
    checks = kw.pop("check", None)
    return case(
        f"api/{id}",
        "api",
        input,
        expect,
        ["python", "train.py"],
        setup=S(*steps),
        kind="python",
        code=kw.pop("code", 0),
        user_training=True,
        check=checks or (_measured("out/report.json") if report else None),
        heavy=kw.pop("heavy", True),
        **kw,
    )


def _measured(rel: str):
    return json_at(rel, lambda r: (r.get("metrics") or {}).get("real_tokens_per_s", 0) > 0, "no measured report", LOSS)


def _rescued(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    import re
    from pathlib import Path

    for m in re.finditer(r"(\S*vlmdoctor-rescued-\S+?\.json)", obs.out):
        p = Path(m.group(1))
        if (p if p.is_absolute() else ctx.work / p).exists():
            return []
    return [(LOSS, "the measured report was neither written nor rescued to a file the output names")]


def _nothing_outside(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    extra = [p.name for p in ctx.outside.iterdir() if p.name != "secret.txt"]
    return [(SECURITY, f"written outside: {extra[:3]}")] if extra else []


def _body(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _doc(out: str = "'out'", args: str = "", each: str = "doc.step(b)", window: str = "**W") -> str:
    """A Doctor over the loop: `out`, extra arguments and the per-step call as the user writes them."""
    return _body(
        f"""
        doc = vlmdoctor.Doctor({args}out={out}, quiet=True, {window})
        with doc:
            got = loop(N, lambda i, m, b: {each})
        """
    )


#: Doctor(model) entered when the loop has built its model; `make` is the model class
ON_MODEL = """
holder = {{}}
def on_model(m):
    holder["d"] = vlmdoctor.Doctor(m, out="out", {quiet}**W).__enter__()
got = loop(N, lambda i, m, b: holder["d"].step(), on_model, make={make})
holder["d"].finish()
"""

ODD = """
class Odd(Tiny):
    def forward(self, input_ids, attention_mask=None, labels=None):
        out = super().forward(input_ids)
        return {"loss": out["loss"], "extra": (x for x in range(3))}
"""

PROFILER_CYCLES = """
from torch.profiler import profile
doc = vlmdoctor.Doctor(out="out", quiet=True, **W)
state = {}
def each(i, m, b):
    doc.step(b)
    if i % 2 == 0:
        state["p"] = profile()
        state["p"].__enter__()
    else:
        state["p"].__exit__(None, None, None)
with doc:
    got = loop(N, each)
"""

IN_THREAD = """
res = {}
def work():
    doc = vlmdoctor.Doctor(out="out", quiet=True, **W)
    with doc:
        res["got"] = loop(N, lambda i, m, b: doc.step(b))
t = threading.Thread(target=work)
t.start()
t.join()
got = res.get("got")
"""

TWO_THREADS = """
res = {}
def work(k):
    doc = vlmdoctor.Doctor(out=f"out{k}", quiet=True, **W)
    with doc:
        res[k] = loop(N, lambda i, m, b: doc.step(b))
ts = [threading.Thread(target=work, args=(k,)) for k in (1, 2)]
[t.start() for t in ts]
[t.join() for t in ts]
got = ref if len(res.get(1) or ()) == N and len(res.get(2) or ()) == N else None  # threads share torch's RNG
"""

AFTER_EXIT = """
doc = vlmdoctor.Doctor(out="out", quiet=True, **W)
with doc:
    got = loop(N, lambda i, m, b: doc.step(b))
for _ in range(3):
    doc.step()
"""

USER_ERROR = """
doc = vlmdoctor.Doctor(out="out", quiet=True, **W)
def each(i, m, b):
    doc.step(b)
    if i == 5:
        raise ValueError("the user's own error")
try:
    with doc:
        loop(N, each)
except ValueError as e:
    got = ref if str(e) == "the user's own error" else None
"""

SLOW_LOOP = """
import time
doc = vlmdoctor.Doctor(out="out", quiet=False, warmup=1, steps=2, trace_steps=5)
def each(i, m, b):
    doc.step(b)
    time.sleep(0.3)
with doc:
    got = loop(40, each)
"""


def api_cases() -> list[Case]:
    cs = [
        api("plain", "baseline", "Doctor over a plain loop: the loop's own losses, a measured report", _doc()),
        api(
            "model-given",
            "baseline",
            "Doctor(model): hooks on the model, the loop's own losses",
            _body(ON_MODEL.format(quiet="quiet=True, ", make="Tiny")),
        ),
        api(
            "out-is-file",
            "wrong-type",
            "out= names a file: said once, the loop runs",
            _doc("'o'"),
            setup=put("o", "mine"),
            report=False,
            ci=True,
        ),
        api(
            "out-link-outside",
            "symlink",
            "out= a link to a folder outside: nothing written outside, the loop runs",
            _doc("'o'"),
            setup=link("o", "{outside}"),
            report=False,
            check=_nothing_outside,
        ),
        api(
            "out-read-only",
            "read-only",
            "out= a read-only mount: the report rescued to a file the line names, the loop runs",
            _doc("'ro'"),
            setup=readonly("ro"),
            report=False,
            check=_rescued,
        ),
        api(
            "out-full",
            "full-disk",
            "out= a full disk: the report rescued and named, the loop runs",
            _doc("'full'"),
            setup=full("full"),
            report=False,
            check=_rescued,
        ),
        api(
            "out-trace-fifo",
            "fifo",
            "out/trace is a fifo: no hang, the loop runs",
            _doc(),
            setup=fifo("out/trace"),
            report=False,
            timeout=60,
        ),
        api(
            "out-report-dir",
            "wrong-type",
            "out/report.json is a folder: said, the loop runs",
            _doc(),
            setup=put("out/report.json/x", "mine"),
            report=False,
        ),
        api(
            "out-number",
            "bad-value",
            "out=123 (not a path): a clear error before the loop, or said and the loop runs",
            _doc("123"),
            report=False,
        ),
        api("out-none", "bad-value", "out=None: the loop runs", _doc("None"), report=False),
        api(
            "steps-zero",
            "bad-value",
            "steps=0: the loop runs (refused or unmeasured, said once)",
            _doc(window="warmup=1, steps=0, trace_steps=1"),
            report=False,
        ),
        api(
            "warmup-negative",
            "bad-value",
            "warmup=-5: the loop runs",
            _doc(window="warmup=-5, steps=2, trace_steps=1"),
            report=False,
        ),
        api(
            "trace-steps-huge",
            "bad-value",
            "trace_steps=10**9: the loop runs, the report written at its end",
            _doc(window="warmup=1, steps=2, trace_steps=10**9"),
            report=False,
        ),
        api(
            "batch-string", "wrong-type", "step('a string'): the loop runs", _doc(each="doc.step('ids')"), report=False
        ),
        api(
            "batch-float-ids",
            "wrong-type",
            "step() with float input_ids and a 3-D mask: the loop runs",
            _doc(each="doc.step({'input_ids': torch.rand(4, 8), 'attention_mask': torch.ones(2, 2, 2)})"),
            report=False,
        ),
        api(
            "batch-meta-tensor",
            "wrong-type",
            "step() with meta-device tensors: the loop runs",
            _doc(each="doc.step({'input_ids': torch.ones(4, 8, dtype=torch.long, device='meta')})"),
            report=False,
        ),
        api(
            "batch-labels-list",
            "wrong-type",
            "step() with labels as a Python list and a 0-d mask: the loop runs",
            _doc(each="doc.step({'input_ids': b['input_ids'], 'attention_mask': torch.tensor(1), 'labels': [1]})"),
            report=False,
        ),
        api(
            "loss-string",
            "wrong-type",
            "step(loss='nan'): the loop runs",
            _doc(each="doc.step(b, loss='nan')"),
            report=False,
        ),
        api(
            "model-not-module",
            "wrong-type",
            "Doctor('my model') (not a module): said once, the loop runs",
            _doc(args="'my model', "),
            report=False,
        ),
        api(
            "forward-returns-tuple",
            "wrong-type",
            "a model whose forward returns a generator among its outputs: hooks never fail the loop",
            _body(ODD) + _body(ON_MODEL.format(quiet="quiet=True, ", make="Odd")),
            report=False,
        ),
        api(
            "hostile-class-name",
            "hostile-string",
            "a model class named with escapes: the report printed escaped, the loop runs",
            f"Hostile = type({HOSTILE!r}, (Tiny,), {{}})\n" + _body(ON_MODEL.format(quiet="", make="Hostile")),
            hostile_text=True,
        ),
        api(
            "user-profiler-cycles",
            "profiler",
            "the user's torch.profiler started and stopped every 2 steps over the Doctor's windows: no crash",
            _body(PROFILER_CYCLES),
            report=False,
        ),
        api(
            "doctor-in-thread",
            "concurrent",
            "the loop runs in a thread, the Doctor with it: the loop's own losses",
            _body(IN_THREAD),
        ),
        api(
            "two-doctors-threads",
            "concurrent",
            "two loops in two threads, a Doctor each: both loops run every step, no crash",
            _body(TWO_THREADS),
            report=False,
        ),
        api(
            "step-after-exit",
            "wrong-type",
            "step() after the with block ended: no error reaches the loop",
            _body(AFTER_EXIT),
        ),
        api(
            "report-exists",
            "output",
            "out/report.json from an earlier run: kept, said once, the loop runs unmeasured",
            _doc(),
            setup=put("out/report.json", '{"earlier": 1}'),
            report=False,
        ),
        api(
            "user-exception",
            "user-error",
            "the loop raises its own error at step 5: it passes through unchanged; no temp file left",
            _body(USER_ERROR),
            report=False,
        ),
        api("tmp-read-only", "read-only", "TMPDIR read-only: the loop runs, measured", _doc(), setup=_ro_tmp),
        case(
            "api/sigint-traced",
            "api",
            "signal",
            "Ctrl-C in the Doctor's traced window: the KeyboardInterrupt reaches the loop as the user's; "
            "no temp file left",
            ["python", "train.py"],
            setup=put("train.py", _script(_body(SLOW_LOOP))),
            kind="python",
            signals=[Signal("out:traced window", SIGINT, delay=0.3)],
            code=(1, 130, -2),
            heavy=True,
            aims=LEAK,
        ),
        case(
            "api/sigterm-traced",
            "api",
            "signal",
            "SIGTERM in the Doctor's traced window: the process ends as it would without vlmdoctor; no temp file left",
            ["python", "train.py"],
            setup=put("train.py", _script(_body(SLOW_LOOP))),
            kind="python",
            signals=[Signal("out:traced window", SIGTERM, delay=0.3)],
            code=(-15, 143),
            heavy=True,
            aims=LEAK,
        ),
    ]
    return cs


def _ro_tmp(ctx: Ctx) -> None:
    ctx.tmpfs("tmp", "1m", ro=True)


TRAINER = r"""
import os, sys
import torch
from torch import nn
torch.set_num_threads(1)
from transformers import Trainer, TrainingArguments, TrainerCallback

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.llm = nn.Embedding(50, 16)
        self.projector = nn.Linear(16, 16)
    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"loss": self.projector(self.llm(input_ids)).pow(2).mean()}

class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 50, (8,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

def train(callbacks, steps=12, **kw):
    torch.manual_seed(0)
    args = TrainingArguments(output_dir="hf", max_steps=steps, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                             dataloader_num_workers=0, **kw)
    t = Trainer(model=Tiny(), args=args, train_dataset=DS(), callbacks=callbacks)
    t.train()
    return [round(h["loss"], 5) for h in t.state.log_history if "loss" in h], t

ref, _ = train([])
import vlmdoctor
from vlmdoctor import DoctorCallback
W = dict(warmup=1, steps=2, trace_steps=1, quiet=True)
"""


def callback(id: str, input: str, expect: str, body: str, setup=None, report: bool = True, **kw) -> Case:
    steps = [put("train.py", TRAINER + body + END)]
    if setup is not None:
        steps.append(setup)
    return case(
        f"callback/{id}",
        "callback",
        input,
        expect,
        ["python", "train.py"],
        setup=S(*steps),
        kind="python",
        code=kw.pop("code", 0),
        user_training=True,
        check=kw.pop("check", None) or (_measured("out/report.json") if report else None),
        heavy=True,
        timeout=kw.pop("timeout", 150),
        **kw,
    )


CB = "got, t = train([DoctorCallback(out={out!r}, **W)])\n"


def callback_cases() -> list[Case]:
    return [
        callback(
            "plain",
            "baseline",
            "DoctorCallback in a Trainer: the Trainer's own losses, a measured report",
            CB.format(out="out"),
        ),
        callback(
            "out-is-file",
            "wrong-type",
            "out= names a file: said, the Trainer trains on",
            CB.format(out="o"),
            setup=put("o", "mine"),
            report=False,
        ),
        callback(
            "out-read-only",
            "read-only",
            "out= a read-only mount: the report rescued and named, the Trainer trains on",
            CB.format(out="ro"),
            setup=readonly("ro"),
            report=False,
            check=_rescued,
        ),
        callback(
            "out-link-outside",
            "symlink",
            "out= a link to a folder outside: nothing written outside",
            CB.format(out="o"),
            setup=link("o", "{outside}"),
            report=False,
            check=_nothing_outside,
        ),
        callback(
            "too-few-steps",
            "wrong-type",
            "max_steps 3, shorter than the window: the Trainer ends as it would, what was measured said",
            "got, t = train([DoctorCallback(out='out', **W)], steps=3)\nref, _ = train([], steps=3)\n",
            report=False,
        ),
        callback(
            "grad-accum",
            "baseline",
            "gradient_accumulation_steps=3: the Trainer's own losses, measured",
            "got, t = train([DoctorCallback(out='out', **W)], gradient_accumulation_steps=3)\n"
            "ref, _ = train([], gradient_accumulation_steps=3)\n",
        ),
        callback(
            "two-callbacks",
            "profiler",
            "two DoctorCallbacks on one Trainer: one profiler at a time, no crash",
            "got, t = train([DoctorCallback(out='o1', **W), DoctorCallback(out='o2', **W)])\n",
            report=False,
        ),
        callback(
            "with-user-profiler",
            "profiler",
            "the user's own torch.profiler around trainer.train(): no crash",
            "from torch.profiler import profile\n"
            "with profile():\n"
            "    got, t = train([DoctorCallback(out='out', **W)])\n",
            report=False,
        ),
        callback(
            "hostile-model",
            "hostile-string",
            "a model class named with escapes: printed escaped, the Trainer's own losses",
            f"Tiny.__name__ = {HOSTILE!r}\n"
            "got, t = train([DoctorCallback(out='out', warmup=1, steps=2, trace_steps=1, quiet=False)])\n",
            hostile_text=True,
        ),
        callback(
            "out-full",
            "full-disk",
            "out= a full disk: the report rescued and named, the Trainer trains on",
            CB.format(out="full"),
            setup=full("full"),
            report=False,
            check=_rescued,
        ),
        callback(
            "report-exists",
            "output",
            "out/report.json from an earlier run: kept, said, the Trainer trains on",
            CB.format(out="out"),
            setup=put("out/report.json", '{"earlier": 1}'),
            report=False,
        ),
    ]


def all_api_cases() -> list[Case]:
    return [*api_cases(), *callback_cases()]
