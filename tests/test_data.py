"""Synthetic data shape, padding, packing, and the LLaVA-format file loader."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import good_record, write_jsonl
from transformers.masking_utils import find_packed_sequence_indices

from vlmdoctor.errors import UsageError
from vlmdoctor.run.data import IGNORE, IMAGE_POOL, BatchSampler, Collator, LlavaFile, SyntheticVQA


@pytest.fixture(scope="module")
def ds05(spec_05b):
    return SyntheticVQA(spec_05b, 4096)


@pytest.fixture(scope="module")
def samples05(ds05):
    return [ds05[i] for i in range(300)]


def _tok(spec, key):
    return spec.llm["special_tokens"][key]


# --- synthetic samples ----------------------------------------------------------------------------


def test_mean_real_length_and_answer_tokens(samples05):
    # targets of the issue: ~340 real tokens per sample for the 0.5b preset, ~190 of them answer tokens
    lengths = [len(s["input_ids"]) for s in samples05]
    answers = [sum(1 for x in s["labels"] if x != IGNORE) for s in samples05]
    assert 330 <= np.mean(lengths) <= 350
    assert 180 <= np.mean(answers) <= 200
    # lengths really vary (otherwise there is no padding to measure)
    assert np.std(lengths) > 20


def test_lengths_table_matches_samples(ds05, samples05):
    assert len(ds05) == 4096
    assert [len(s["input_ids"]) for s in samples05] == ds05.lengths[:300]


def test_samples_are_deterministic(spec_05b, ds05):
    again = SyntheticVQA(spec_05b, 4096)
    assert again[7]["input_ids"] == ds05[7]["input_ids"]
    assert torch.equal(again[7]["pixel_values"], ds05[7]["pixel_values"])
    other_seed = SyntheticVQA(spec_05b, 4096, seed=1)
    assert other_seed.lengths != ds05.lengths


def test_labels_are_one_answer_span_ending_with_im_end(spec_05b, samples05):
    im_start, im_end = _tok(spec_05b, "im_start"), _tok(spec_05b, "im_end")
    for s in samples05[:50]:
        ids, labels = s["input_ids"], s["labels"]
        assert len(ids) == len(labels)
        pos = [k for k, x in enumerate(labels) if x != IGNORE]
        assert pos, "no answer tokens"
        assert pos == list(range(pos[0], pos[-1] + 1)), "answer span is not contiguous"
        assert [labels[k] for k in pos] == [ids[k] for k in pos]  # labels are the tokens themselves
        assert ids[pos[-1]] == im_end
        # the span follows the assistant header `<|im_start|> assistant \n` (the last <|im_start|>)
        assert ids[pos[0] - 3] == im_start
        assert max(k for k, x in enumerate(ids) if x == im_start) == pos[0] - 3
        # exactly three turns
        assert ids.count(im_start) == 3 and ids.count(im_end) == 3


def test_image_pad_tokens_sit_between_vision_markers(spec_05b, samples05):
    pad_img, vs, ve = (
        _tok(spec_05b, "image_pad"),
        _tok(spec_05b, "vision_start"),
        _tok(spec_05b, "vision_end"),
    )
    for s in samples05[:50]:
        ids = s["input_ids"]
        assert ids.count(pad_img) == spec_05b.image_tokens == 49
        assert ids.count(vs) == 1 and ids.count(ve) == 1
        a, b = ids.index(vs), ids.index(ve)
        assert ids[a + 1 : b] == [pad_img] * spec_05b.image_tokens
        assert s["pixel_values"].shape == (3, 224, 224)
        assert -1.0 <= float(s["pixel_values"].min()) and float(s["pixel_values"].max()) <= 1.0


def test_text_tokens_avoid_special_ids(spec_05b, samples05):
    special = set(spec_05b.llm["special_tokens"].values())
    vocab = spec_05b.llm["config"]["vocab_size"]
    for s in samples05[:20]:
        assert max(s["input_ids"]) < vocab
        text = [x for x in s["input_ids"] if x not in special]
        assert min(text) >= spec_05b.llm["text_token_range"][0]
        assert spec_05b.llm["special_tokens"]["pad"] not in s["input_ids"]


# --- padding ----------------------------------------------------------------------------------------


def _padding(ds, batch_size, bucketed, n_batches=100, seed=0, multiple=1, packing=False):
    """Pad fraction measured by the real collator over n_batches of the real sampler."""
    ds.with_pixels = False
    try:
        pad_id = _tok(ds.spec, "pad")
        collate = Collator(
            pad_id, pad_to_multiple_of=multiple, packing=packing, vision_features=torch.zeros(IMAGE_POOL, 1)
        )
        real = padded = 0
        it = iter(BatchSampler(ds.lengths, batch_size, bucketed=bucketed, seed=seed))
        for _ in range(n_batches):
            c = collate([ds[i] for i in next(it)])["counts"]
            real += c["real_tokens"]
            padded += c["padded_tokens"]
        return 1 - real / padded
    finally:
        ds.with_pixels = True


def test_padding_random_batches_of_4(ds05):
    assert 0.09 <= _padding(ds05, 4, bucketed=False) <= 0.15


def test_padding_random_batches_of_16(ds05):
    pad16 = _padding(ds05, 16, bucketed=False)
    assert 0.14 <= pad16 <= 0.21
    assert pad16 > _padding(ds05, 4, bucketed=False)  # bigger batches, longer max -> more padding


def test_padding_length_bucketed_batches_of_16(ds05):
    assert _padding(ds05, 16, bucketed=True) < 0.03


def test_batch_sampler_covers_samples_once_per_epoch():
    lengths = list(np.random.default_rng(0).integers(50, 400, 203))
    for bucketed in (False, True):
        s = BatchSampler(lengths, 8, bucketed=bucketed, seed=3)
        batches = list(s)
        assert len(batches) == len(s) == 203 // 8
        assert all(len(b) == 8 for b in batches)
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat))  # no sample twice in an epoch
        second = list(s)
        assert second != batches  # a new shuffle each epoch


def test_bucketed_batches_are_not_in_length_order():
    # bucketing sorts inside mega-batches but the batches themselves are shuffled
    lengths = list(np.random.default_rng(1).integers(50, 400, 4000))
    batches = list(BatchSampler(lengths, 4, bucketed=True, seed=0))
    maxes = [max(lengths[i] for i in b) for b in batches]
    assert maxes != sorted(maxes) and maxes != sorted(maxes, reverse=True)


def test_pad_to_multiple_of_64(ds05):
    collate = Collator(_tok(ds05.spec, "pad"), pad_to_multiple_of=64)
    for start in range(0, 40, 4):
        batch = collate([ds05[i] for i in range(start, start + 4)])
        width = batch["input_ids"].shape[1]
        c = batch["counts"]
        assert width % 64 == 0
        assert max(c["lengths"]) <= width < max(c["lengths"]) + 64
        assert c["real_tokens"] == int(batch["attention_mask"].sum()) == sum(c["lengths"])
        assert c["padded_tokens"] == 4 * width
        assert c["loss_tokens"] == int((batch["labels"] != IGNORE).sum())
        # padding is on the right and is ignored by the loss
        for r, k in enumerate(c["lengths"]):
            assert batch["attention_mask"][r, :k].all() and not batch["attention_mask"][r, k:].any()
            assert (batch["labels"][r, k:] == IGNORE).all()


# --- packing ----------------------------------------------------------------------------------------


def _segments(row_pos):
    """Real-token segments of one packed row: (start, end) per packed sample, by the transformers rule."""
    seq = find_packed_sequence_indices(row_pos[None])
    assert seq is not None
    seq = seq[0]
    return [(int((seq == s).nonzero()[0]), int((seq == s).nonzero()[-1]) + 1) for s in seq.unique()]


@pytest.mark.parametrize("pack_length", [1024, 2048])
def test_packing_rows_positions_and_counts(ds05, pack_length):
    samples = [ds05[i] for i in range(8)]
    batch = Collator(_tok(ds05.spec, "pad"), packing=True, pack_length=pack_length)(samples)
    c = batch["counts"]
    assert batch["attention_mask"] is None
    assert c["real_tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert c["rows"] < len(samples)  # samples really share rows
    assert c["loss_tokens"] == sum(sum(1 for x in s["labels"] if x != IGNORE) for s in samples)
    by_ids = {tuple(s["input_ids"]): s for s in samples}
    found = []
    pad_id = _tok(ds05.spec, "pad")
    for r in range(c["rows"]):
        ids, pos = batch["input_ids"][r], batch["position_ids"][r]
        real = int((ids != pad_id).sum())
        assert real <= pack_length
        segs = _segments(pos)
        # every segment is one whole sample, its positions restart at 0, distinct segment ids per sample
        for a, b in segs:
            assert int(pos[a]) == 0
            assert pos[a:b].tolist() == list(range(b - a))
            if a < real:
                key = tuple(ids[a:b].tolist())
                assert key in by_ids, "a packed segment is not one whole sample"
                found.append(key)
                assert batch["labels"][r, a:b].tolist() == by_ids[key]["labels"]
            else:
                assert (ids[a:b] == pad_id).all()  # the padding tail is its own segment
        assert sum(b - a for a, b in segs if a < real) == real
    assert sorted(found) == sorted(by_ids)  # every sample exactly once
    # image order follows sample order in the packed rows
    assert batch["pixel_values"].shape[0] == len(samples)
    for k, key in enumerate(found):
        assert torch.equal(batch["pixel_values"][k], by_ids[key]["pixel_values"])


def test_packing_sample_longer_than_pack_length_gets_own_row(ds05):
    samples = [ds05[i] for i in range(4)]
    batch = Collator(_tok(ds05.spec, "pad"), packing=True, pack_length=256)(samples)
    c = batch["counts"]
    assert all(k > 256 for k in c["lengths"])
    assert c["rows"] == 4
    assert c["width"] == max(c["lengths"])


def test_packing_beats_padding(ds05):
    samples = [ds05[i] for i in range(16)]
    pad_id = _tok(ds05.spec, "pad")
    padded = Collator(pad_id)(samples)["counts"]
    packed = Collator(pad_id, packing=True, pack_length=2048)(samples)["counts"]
    assert packed["real_tokens"] == padded["real_tokens"]
    assert packed["padded_tokens"] < padded["padded_tokens"]


def test_packing_never_pads_more_than_no_packing(ds05):
    assert _padding(ds05, 8, bucketed=False, n_batches=50, packing=True) <= _padding(
        ds05, 8, bucketed=False, n_batches=50
    )


def test_packed_and_padded_batches_give_the_same_logits_as_single_samples(tiny_spec):
    """No cross-sample attention in packed rows and no padding leak in padded rows, checked on the model:
    each sample's logits inside a batch equal its logits when run alone."""
    from vlmdoctor.run.model import build_model

    torch.manual_seed(0)
    model = build_model(tiny_spec, device="cpu").eval()
    ds = SyntheticVQA(tiny_spec, 16)
    samples = [ds[i] for i in range(4)]
    pad_id = _tok(tiny_spec, "pad")

    def logits(collator, batch_samples, **override):
        b = collator(batch_samples)
        b.pop("counts")
        b.update(override)
        with torch.no_grad():
            return model(**b).logits

    alone = {tuple(s["input_ids"]): logits(Collator(pad_id), [s])[0] for s in samples}

    packed_collator = Collator(pad_id, packing=True, pack_length=4096)
    packed = logits(packed_collator, samples)
    assert packed.shape[0] == 1
    order = sorted(samples, key=lambda s: -len(s["input_ids"]))
    at = 0
    for s in order:
        k = len(s["input_ids"])
        torch.testing.assert_close(packed[0, at : at + k], alone[tuple(s["input_ids"])], atol=1e-4, rtol=1e-4)
        at += k

    # the check has teeth: with one running position sequence the samples do attend to each other
    width = packed.shape[1]
    leaky = logits(packed_collator, samples, position_ids=torch.arange(width)[None])
    k0, k1 = len(order[0]["input_ids"]), len(order[1]["input_ids"])
    assert (leaky[0, k0 : k0 + k1] - alone[tuple(order[1]["input_ids"])]).abs().max() > 1e-2

    padded = logits(Collator(pad_id, pad_to_multiple_of=64), samples)
    for r, s in enumerate(samples):
        k = len(s["input_ids"])
        torch.testing.assert_close(padded[r, :k], alone[tuple(s["input_ids"])], atol=1e-4, rtol=1e-4)


# --- LLaVA-format files -------------------------------------------------------------------------------


def _ids(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return tok, {
        k: tok.convert_tokens_to_ids(f"<|{k}|>")
        for k in ("im_start", "im_end", "vision_start", "vision_end", "image_pad")
    }


def test_llava_jsonl_good_records(llava_dir, tokenizer_dir, tiny_spec):
    path = write_jsonl(llava_dir / "data.jsonl", [good_record(f"images/img{k}.png", k) for k in range(3)])
    ds = LlavaFile(str(path), str(tokenizer_dir), tiny_spec)
    tok, ids = _ids(tokenizer_dir)
    assert len(ds) == 3 and ds.stats.records == 3 and ds.stats.skipped == 0
    assert ds.lengths == [len(ds[i]["input_ids"]) for i in range(3)]
    for k in range(3):
        s = ds[k]
        assert len(s["input_ids"]) == len(s["labels"])
        assert max(s["input_ids"]) < tiny_spec.llm["config"]["vocab_size"]
        # labels only on the gpt turns, each ending with <|im_end|>
        labeled = [x for x in s["labels"] if x != IGNORE]
        assert tok.decode(labeled) == f"A red cat sits on a blue mat {k}.<|im_end|>There are two animals.<|im_end|>"
        for pos, lab in enumerate(s["labels"]):
            if lab != IGNORE:
                assert lab == s["input_ids"][pos]
        # the human turns are never labeled
        assert "What is in the picture" not in tok.decode(labeled)
        # one image: image_tokens pads between the vision markers
        seq = s["input_ids"]
        a, b = seq.index(ids["vision_start"]), seq.index(ids["vision_end"])
        assert seq[a + 1 : b] == [ids["image_pad"]] * tiny_spec.image_tokens
        assert seq.count(ids["image_pad"]) == tiny_spec.image_tokens
        px = s["pixel_values"]
        assert px.shape == (3, tiny_spec.vision["input_size"], tiny_spec.vision["input_size"])
        assert -1.0 <= float(px.min()) and float(px.max()) <= 1.0
    assert not torch.equal(ds[0]["pixel_values"], ds[1]["pixel_values"])


def test_llava_json_list_and_absolute_paths(llava_dir, tokenizer_dir, tiny_spec):
    recs = [good_record(str(llava_dir / "images/img0.png"), 0), good_record("images/img1.png", 1)]
    path = llava_dir / "data.json"
    path.write_text(json.dumps(recs))
    ds = LlavaFile(str(path), str(tokenizer_dir), tiny_spec)
    assert len(ds) == 2


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ('{"image": "images/img1.png", "conversations": [', "not valid JSON"),
        (json.dumps(good_record("images/missing.png")), "image not found"),
        (json.dumps({"image": "images/img1.png"}), "conversations"),
        (
            json.dumps(
                {
                    "image": "images/img1.png",
                    "conversations": [
                        {"from": "human", "value": "no image tag"},
                        {"from": "gpt", "value": "x"},
                    ],
                }
            ),
            "<image>",
        ),
    ],
)
def test_llava_bad_record_stop_and_skip(llava_dir, tokenizer_dir, tiny_spec, bad_line, problem):
    # line 2 is blank: line numbers are those of the file, blank lines included
    lines = [good_record("images/img0.png", 0), "", bad_line, good_record("images/img2.png", 2)]
    path = write_jsonl(llava_dir / "data.jsonl", lines)
    with pytest.raises(UsageError) as ei:
        LlavaFile(str(path), str(tokenizer_dir), tiny_spec, bad_records="stop")
    msg = str(ei.value)
    assert "line 3" in msg and problem in msg
    assert "--bad-records skip" in msg

    ds = LlavaFile(str(path), str(tokenizer_dir), tiny_spec, bad_records="skip")
    assert len(ds) == 2
    assert ds.stats.records == 3
    assert ds.stats.skipped == 1
    assert len(ds.stats.problems) == 1 and "line 3" in ds.stats.problems[0]
    assert "mat 0." in _ids(tokenizer_dir)[0].decode(ds[0]["input_ids"])
    assert "mat 2." in _ids(tokenizer_dir)[0].decode(ds[1]["input_ids"])


def test_llava_json_list_bad_record_names_index(llava_dir, tokenizer_dir, tiny_spec):
    path = llava_dir / "data.json"
    path.write_text(json.dumps([good_record("images/img0.png"), good_record("images/nope.png")]))
    with pytest.raises(UsageError, match="record 1"):
        LlavaFile(str(path), str(tokenizer_dir), tiny_spec)


def test_llava_all_records_bad_is_usage_error(llava_dir, tokenizer_dir, tiny_spec):
    path = write_jsonl(llava_dir / "data.jsonl", ["{", "[1, 2"])
    with pytest.raises(UsageError, match="no usable records"):
        LlavaFile(str(path), str(tokenizer_dir), tiny_spec, bad_records="skip")


def test_llava_needs_file_and_local_tokenizer(llava_dir, tokenizer_dir, tiny_spec, tmp_path):
    path = write_jsonl(llava_dir / "data.jsonl", [good_record("images/img0.png")])
    with pytest.raises(UsageError, match="--tokenizer"):
        LlavaFile(str(path), None, tiny_spec)
    with pytest.raises(UsageError, match="no such file"):
        LlavaFile(str(llava_dir / "missing.jsonl"), str(tokenizer_dir), tiny_spec)
    empty = tmp_path / "not_a_tokenizer"
    empty.mkdir()
    with pytest.raises(UsageError, match="--tokenizer"):
        LlavaFile(str(path), str(empty), tiny_spec)


def test_profile_on_llava_file_counts_skipped_records(llava_dir, tokenizer_dir, tiny_cfg):
    from vlmdoctor.run.runner import run_profile

    lines = [good_record(f"images/img{k}.png", k) for k in range(5)] + ["{broken"]
    path = write_jsonl(llava_dir / "data.jsonl", lines)
    cfg = tiny_cfg(data=str(path), tokenizer=str(tokenizer_dir), bad_records="skip", batch_size=2)
    report = run_profile(cfg)
    assert report["status"] == "ok", report.get("error")
    assert report["data"]["records"] == 6
    assert report["data"]["skipped"] == 1
    assert report["data"]["samples"] == 5
    assert "line 6" in report["data"]["problems"][0]
    assert report["metrics"]["real_tokens_per_s"] > 0


def test_shipped_length_model_matches_fixture_copy():
    from pathlib import Path

    from vlmdoctor.run.data import length_model

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "lengths" / "sharegpt4v_coco.json"
    if not fixture.exists():
        pytest.skip("no fixtures/ folder in this checkout")
    assert json.loads(fixture.read_text()) == length_model()
