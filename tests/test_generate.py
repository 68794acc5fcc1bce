"""Batched, continuous generation (workers.generate.generator) against HF transformers: greedy token
ids equal to HF `generate`, every stored activation (prompt and generated tokens) equal to
HF's forward over prompt + generated, sampling streams that depend on (seed, document,
sample) only, and bad settings refused by name."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import numpy as np
import pytest

from actx.workers.generate import (generator as generate, config as generate_config, step as
                                   generate_step, sampling)
from actx.workers.model import capture
from actx.workers.model import decoder as model_lib
from tests import hf_models, worker_procs

HOOKS = "embed,layers.*.resid_post,layers.*.attn_out,layers.*.mlp_out,final_norm"
MOE_HOOKS = HOOKS + ",layers.*.router_logits,layers.*.experts"
# Five prompts on two slots (refills), one longer than three prefill rows of 8 tokens,
# and one longer than Gemma's 12-token window.
LENGTHS = (5, 13, 3, 20, 9)
SLOTS, PREFILL, MAX_NEW, MAX_LENGTH = 2, 8, 10, 48
# One architecture per code path of the decoder (tied and untied heads, q/k/v biases,
# q/k norms per head and whole, Gemma 2's soft-caps and windows, Gemma 3's local RoPE,
# Phi-3's fused tensors and partial rotary, OLMo 2's post-norms, a mixture of experts),
# so the file stays near a minute; ALL_ARCHS=1 runs every architecture of
# tests.hf_models (each passed when this was written).
ARCHS = (tuple(a for a in hf_models.ARCHS if a != "phi3_longrope")
         if os.environ.get("ALL_ARCHS") else
         ("qwen2", "llama3", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "olmoe"))


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return hf_models.checkpoint_maker(tmp_path_factory)


def _prompts(seed=0, lengths=LENGTHS):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 512, n).astype(np.int32) for n in lengths]


def _generator(path, config, hooks=HOOKS, dtype="float32", slots=SLOTS, prefill=PREFILL,
               max_length=MAX_LENGTH, attention=None):
    model = model_lib.load_pretrained(path, dtype=dtype)
    spec = capture.CaptureSpec.parse(hooks, dtype=dtype)
    return generate.Generator(model, generate_step.load_lm_head(path, model), spec, config,
                              slots=slots, max_length=max_length, prefill_len=prefill,
                              attention=attention)


def _hf_greedy(hf, prompt, max_new, stop_ids):
    """HF generate's greedy continuation of one prompt (batch 1: no padding)."""
    import torch

    ids = torch.as_tensor(prompt[None], dtype=torch.long)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=max_new, eos_token_id=list(stop_ids) or None,
                      pad_token_id=0)
    return out[0, len(prompt):].numpy()


def _compare_activations(sample, hf, rel=1e-5):
    full = np.concatenate([sample.prompt_ids, sample.generated_ids])
    ref = hf_models.hf_hooks(hf, full[None])
    for name, acts in sample.activations.items():
        assert acts.shape[0] == len(full), name
        what = f"prompt {sample.prompt_index} sample {sample.sample_index} {name}"
        if name.endswith("expert_ids"):
            np.testing.assert_array_equal(acts, ref[name][0], err_msg=what)
        else:
            worker_procs.assert_close(acts, ref[name][0], rel, what)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_activations_equal_hf(ckpt_dir, arch):
    """Greedy float32 ids equal HF generate's for every prompt (refills, a stop token hit
    by some, prompts over several prefill rows), and every activation of prompt and
    generated tokens equals HF's forward over both, 1e-5 relative."""
    path = ckpt_dir(arch)
    hf = hf_models.load_hf_model(path)
    prompts = _prompts()
    # A stop id some prompts reach: the 4th token HF generates for the first prompt.
    stop = int(_hf_greedy(hf, prompts[0], MAX_NEW, ())[3])
    config = generate_config.GenerateConfig(max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
    hooks = MOE_HOOKS if arch in hf_models.MOE_ARCHS else HOOKS
    samples = _generator(path, config, hooks).run(prompts)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, 0) for i in range(5)]
    for s, prompt in zip(samples, prompts):
        np.testing.assert_array_equal(s.prompt_ids, prompt)
        np.testing.assert_array_equal(s.token_ids[:len(prompt)], prompt)
        assert s.generated_mask.sum() == len(s.generated_ids) and s.generated_mask[-1]
        expected = _hf_greedy(hf, prompt, MAX_NEW, (stop,))
        np.testing.assert_array_equal(s.generated_ids, expected,
                                      err_msg=f"prompt {s.prompt_index}")
        if s.generated_ids[-1] == stop:
            assert s.stop_reason == generate.STOP_TOKEN
        else:
            assert s.stop_reason == generate.LENGTH and len(s.generated_ids) == MAX_NEW
        _compare_activations(s, hf)
    assert samples[0].stop_reason == generate.STOP_TOKEN


def test_bfloat16_activations_of_its_own_text(ckpt_dir):
    """bfloat16: each token's activations within 2e-2 relative L2 of HF float32 on the
    text bfloat16 generated (or no further than HF's own bfloat16)."""
    import torch

    path = ckpt_dir("llama3")
    hf = hf_models.load_hf_model(path)
    config = generate_config.GenerateConfig(max_new_tokens=MAX_NEW)
    samples = _generator(path, config, dtype="bfloat16").run(_prompts()[:2])
    hf_bf16 = hf_models.load_hf_model(path).to(torch.bfloat16)
    for s in samples:
        full = np.concatenate([s.prompt_ids, s.generated_ids])[None]
        ref, ref_bf16 = hf_models.hf_hooks(hf, full), hf_models.hf_hooks(hf_bf16, full)
        for name, acts in s.activations.items():
            assert str(acts.dtype) == "bfloat16"
            err = np.linalg.norm(acts.astype(np.float32) - ref[name][0]) / np.linalg.norm(
                ref[name][0])
            own = np.linalg.norm(ref_bf16[name][0] - ref[name][0]) / np.linalg.norm(
                ref[name][0])
            assert err <= max(2e-2, own), (name, err)


def test_step_compiles_once_per_shape(ckpt_dir):
    """Two shapes (prefill rows, one-token decode), each traced once, whatever runs; a
    second run on the same slots (caches holding the first run's texts) is as exact."""
    path = ckpt_dir("qwen2_untied")
    gen = _generator(path, generate_config.GenerateConfig(max_new_tokens=6))
    gen.run(_prompts(1))
    assert gen.trace_count == 2
    prompts = _prompts(2, lengths=(17, 1, 30, 4, 2, 11))
    samples = gen.run(prompts)
    assert gen.trace_count == 2
    hf = hf_models.load_hf_model(path)
    for s, prompt in zip(samples, prompts):
        np.testing.assert_array_equal(s.generated_ids, _hf_greedy(hf, prompt, 6, ()))
        _compare_activations(s, hf)


def test_on_a_mesh_slots_over_data_and_heads_over_model(ckpt_dir):
    """On a (data 2 x model 2) mesh of CPU devices (slots split over data, weights, kv
    heads over model), still HF's greedy text and HF's activations."""
    import jax

    from actx.workers.model import sharding

    path = ckpt_dir("llama3")
    mesh = sharding.make_mesh(data=2, model=2, devices=jax.devices()[:4])
    model = model_lib.load_pretrained(path, mesh=mesh)
    gen = generate.Generator(model, generate_step.load_lm_head(path, model),
                             capture.CaptureSpec.parse(HOOKS),
                             generate_config.GenerateConfig(max_new_tokens=MAX_NEW), slots=4,
                             max_length=MAX_LENGTH, prefill_len=PREFILL)
    prompts = _prompts(6)
    hf = hf_models.load_hf_model(path)
    for s, prompt in zip(gen.run(prompts), prompts):
        np.testing.assert_array_equal(s.generated_ids, _hf_greedy(hf, prompt, MAX_NEW, ()))
        _compare_activations(s, hf)
    # The record of fed ids a repetition penalty needs, split over data as the slots.
    penalised = generate.Generator(
        model, generate_step.load_lm_head(path, model), capture.CaptureSpec.parse(HOOKS),
        generate_config.GenerateConfig(max_new_tokens=MAX_NEW, repetition_penalty=3.0),
        slots=4, max_length=MAX_LENGTH, prefill_len=PREFILL)
    import torch
    for s, prompt in zip(penalised.run(prompts), prompts):
        ids = torch.tensor(prompt[None].astype(np.int64))
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=MAX_NEW, pad_token_id=0, repetition_penalty=3.0)
        np.testing.assert_array_equal(s.generated_ids, ref[0, len(prompt):].numpy())
    with pytest.raises(ValueError, match="batch size 3 is not divisible"):
        generate.Generator(model, generate_step.load_lm_head(path, model),
                           capture.CaptureSpec.parse(HOOKS),
                           generate_config.GenerateConfig(max_new_tokens=MAX_NEW), slots=3,
                           max_length=MAX_LENGTH)


def test_a_finished_slot_takes_the_next_prompt_at_once(ckpt_dir):
    """Continuous batching: prompt 0 stops at its first token, so its slot feeds that
    token (step 2), then prefills prompt 2 (step 3) while prompt 1 is mid-answer; then 8
    decode steps finish both. Static batches of 2 would take 9 + 9 steps. A caller's
    `before_step` runs before each step and may stop the generation there."""
    path = ckpt_dir("qwen2_untied")
    hf = hf_models.load_hf_model(path)
    prompts = _prompts(7, lengths=(6, 4, 7))
    free = [_hf_greedy(hf, p, MAX_NEW - 2, ()) for p in prompts]
    stop = int(free[0][0])
    assert stop not in free[1] and stop not in free[2]  # these prompts' own texts
    gen = _generator(path, generate_config.GenerateConfig(max_new_tokens=MAX_NEW - 2,
                                                   stop_token_ids=(stop,)))
    order = [(s.prompt_index, len(s.generated_ids)) for s in gen.samples(prompts)]
    assert order[0] == (0, 1) and sorted(order[1:]) == [(1, 8), (2, 8)]
    assert gen.steps == 3 + 8
    # before_step sees each step of the call by its index, before it runs (a worker's
    # stop and crash point); what it raises ends the generation there, mid-answer.
    seen = []
    steps = gen.steps
    done = list(gen.samples(prompts, before_step=seen.append))
    assert seen == list(range(gen.steps - steps)) and len(done) == 3

    def stop_at_5(step):
        if step == 5:
            raise KeyboardInterrupt(step)

    steps = gen.steps
    with pytest.raises(KeyboardInterrupt):
        list(gen.samples(prompts, before_step=stop_at_5))
    assert gen.steps - steps == 5


SAMPLED = dict(max_new_tokens=8, temperature=1.0, top_k=100, top_p=0.95, seed=7)


def test_sampling_depends_on_seed_document_and_sample_only(ckpt_dir):
    """The same (seed, document, sample) samples the same text whatever the prompt order,
    the slot it lands in and the slot count, and the same bytes on the same slot count
    (another slot count changes the matmuls' shapes: XLA may round differently, so
    activations agree to float32 rounding there); another sample index or seed, another
    stream (`test_draws_follow_their_keys` holds the seed's part)."""
    path = ckpt_dir("qwen2_untied")
    prompts = _prompts(3)
    config = generate_config.GenerateConfig(samples_per_prompt=2, **SAMPLED)
    documents = [10, 11, 12, 13, 14]
    first = _generator(path, config, slots=3).run(prompts, documents=documents)
    hf = hf_models.load_hf_model(path)
    for s in first:  # sampled text has exact activations too
        _compare_activations(s, hf)
    order = [3, 0, 4, 1, 2]
    reordered = [prompts[i] for i in order], [documents[i] for i in order]
    for slots, same_bytes in ((3, True), (1, False)):
        second = _generator(path, config, slots=slots).run(*reordered)
        again = {(order[s.prompt_index], s.sample_index): s for s in second}
        for s in first:
            other = again[(s.prompt_index, s.sample_index)]
            np.testing.assert_array_equal(s.generated_ids, other.generated_ids)
            assert s.stop_reason == other.stop_reason
            for name, acts in s.activations.items():
                if same_bytes:
                    assert acts.tobytes() == other.activations[name].tobytes(), name
                else:
                    worker_procs.assert_close(acts, other.activations[name], 1e-6, name)
    for i in range(len(prompts)):
        a, b = first[2 * i], first[2 * i + 1]
        assert (a.prompt_index, a.sample_index, b.sample_index) == (i, 0, 1)
        assert not np.array_equal(a.generated_ids, b.generated_ids)


def test_warpers_equal_hf_logits_processors():
    """Temperature, top-k and top-p keep exactly the tokens HF's warpers keep, with the
    same values. With ties (rounded logits, as half-precision logits often are): top-k
    keeps every token tied with the k-th, as HF's does; top-p keeps every token tied with
    the least likely one it keeps (docs/generate.md), where HF's keeps those its sort puts
    last."""
    import torch
    from transformers.generation import logits_process as lp

    drawn = np.random.RandomState(0).standard_normal((4, 512)).astype(np.float32) * 3
    for logits, (temperature, top_k, top_p) in itertools.product(
            (drawn, np.round(drawn)), ((0.7, 0, 1.0), (1.0, 20, 1.0), (1.3, 0, 0.8),
                                       (0.5, 50, 0.3), (2.0, 1, 0.9))):
        scores = torch.as_tensor(logits)
        for warper in (lp.TemperatureLogitsWarper(temperature),
                       top_k and lp.TopKLogitsWarper(top_k),
                       top_p < 1 and lp.TopPLogitsWarper(top_p)):
            if warper:
                scores = warper(None, scores)
        ours = np.asarray(sampling.warp(logits, temperature, top_k, top_p))
        ref = scores.numpy()
        kept = np.isfinite(ref)
        if top_p < 1 and logits is not drawn:
            lowest = np.where(kept, ref, np.inf).min(axis=-1, keepdims=True)
            kept |= np.isfinite(ours) & (ours == lowest)
        np.testing.assert_array_equal(np.isfinite(ours), kept)
        np.testing.assert_allclose(ours[np.isfinite(ours)], logits[np.isfinite(ours)] /
                                   np.float32(temperature), rtol=1e-6)


def test_top_k_one_samples_hf_greedy_text(ckpt_dir):
    """The sampling path draws from each slot's own logits: with top_k=1 it must write
    HF's greedy text, whatever the temperature."""
    path = ckpt_dir("qwen2_untied")
    prompts = _prompts(5)[:3]
    sampled = _generator(path, generate_config.GenerateConfig(
        max_new_tokens=6, temperature=1.5, top_k=1, seed=3)).run(prompts)
    hf = hf_models.load_hf_model(path)
    for s, prompt in zip(sampled, prompts):
        np.testing.assert_array_equal(s.generated_ids, _hf_greedy(hf, prompt, 6, ()))


def test_draws_follow_their_keys():
    """A draw depends on (seed, document, sample, token index) and not on its slot: the
    same keys in other slots draw the same tokens; another seed or sample draws others."""
    logits = np.zeros((6, 512), np.float32)  # uniform: every token equally likely

    def draw(seed, document, sample, index):
        return np.asarray(sampling.choose(
            logits, temperature=1.0, top_k=0, top_p=1.0, seed=seed,
            document_b=np.asarray(document, np.int32), sample_b=np.asarray(sample, np.int32),
            index_b=np.asarray(index, np.int32)))

    base = draw(7, [1, 2, 3, 4, 5, 6], [0] * 6, [0, 1, 2, 3, 4, 5])
    moved = draw(7, [6, 5, 4, 3, 2, 1], [0] * 6, [5, 4, 3, 2, 1, 0])
    np.testing.assert_array_equal(base, moved[::-1])
    assert not np.array_equal(base, draw(8, [1, 2, 3, 4, 5, 6], [0] * 6, range(6)))
    assert not np.array_equal(base, draw(7, [1, 2, 3, 4, 5, 6], [1] * 6, range(6)))
    assert len(set(base.tolist())) > 1
    ties = np.asarray([[0.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0]], np.float32)
    greedy = sampling.choose(ties, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                             document_b=None, sample_b=None, index_b=None)
    np.testing.assert_array_equal(greedy, [1, 0])  # ties: the lowest id, as torch.argmax


@pytest.mark.parametrize("changes, key", [
    (dict(max_new_tokens=4096), "generate.max_new_tokens"),   # the model's 4096 positions
    (dict(max_new_tokens=MAX_LENGTH), "generate.max_new_tokens"),  # the cache's length
    (dict(max_new_tokens=0), "generate.max_new_tokens"),
    (dict(temperature=-0.5), "generate.temperature"),
    (dict(stop_token_ids=(2, 512)), "generate.stop_token_ids"),
    (dict(stop_token_ids=(-1,)), "generate.stop_token_ids"),
    (dict(top_p=0.0), "generate.top_p"),
    (dict(top_k=-1), "generate.top_k"),
    (dict(samples_per_prompt=0), "generate.samples_per_prompt"),
    (dict(seed=-1), "generate.seed"),
])
def test_bad_settings_are_refused_by_name(ckpt_dir, changes, key):
    config = generate_config.GenerateConfig(**{"max_new_tokens": 4, **changes})
    with pytest.raises(generate_config.GenerateError, match=key):
        _generator(ckpt_dir("qwen2_untied"), config)


def test_prompts_that_cannot_run_are_refused_before_any_step(ckpt_dir):
    gen = _generator(ckpt_dir("qwen2_untied"), generate_config.GenerateConfig(max_new_tokens=10))
    for prompts, words in (([np.arange(3, 10), np.arange(3, 42)], "prompt 1: 39 tokens"),
                           ([[]], "prompt 0 is empty"),
                           ([[5, 512]], "prompt 0: token ids outside")):
        with pytest.raises(generate_config.GenerateError, match=words):
            gen.run(prompts)
    assert gen.trace_count == 0


def test_longrope_is_refused_by_name(ckpt_dir):
    config = generate_config.GenerateConfig(max_new_tokens=4)
    with pytest.raises(generate_config.GenerateError, match="longrope"):
        _generator(ckpt_dir("phi3_longrope"), config)


def test_a_generation_config_setting_it_does_not_apply_is_said(ckpt_dir, tmp_path):
    """A checkpoint's generation_config.json may set what HF `generate` applies besides
    the generate section (Qwen2.5-Instruct: repetition_penalty 1.05). actx applies only
    the run's own settings: the pre-flight names the checkpoint's, the HF call actx's
    answers equal and the key that takes the checkpoint's penalty; followed, the answers
    are HF generate's defaults (reference: HF generate with that setting off, and on)."""
    import torch

    from actx.schemas import runspec
    from actx.workers import preflight

    path = str(tmp_path / "model")
    shutil.copytree(ckpt_dir("qwen2"), path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"repetition_penalty": 1.5, "do_sample": True, "temperature": 0.7,
                   "top_p": 0.8, "top_k": 20, "typical_p": 0.9,
                   "no_repeat_ngram_size": 3}, f)
    spec = runspec.RunSpec.from_dict({
        "model": {"path": path}, "tokenizer": {"path": "unused"},
        "sources": [{"kind": "text", "paths": ["none.jsonl"]}],
        "packing": {"mode": "segmented", "seq_len": 32},
        "capture": {"hooks": "layers.0.resid_post"}, "generate": {"max_new_tokens": 8}})
    where = f"{path}/generation_config.json"
    assert preflight.generate_notes(spec) == [
        f"{where} sets repetition_penalty=1.5, which HF generate applies by default; this "
        f"run's generate.repetition_penalty is 1.0, so its answers are HF generate's with "
        f"repetition_penalty=1.0 (set generate.repetition_penalty: 1.5 for HF generate's "
        f"default answers)",
        f"{where} sets no_repeat_ngram_size=3, which actx's generator does not apply: its "
        f"answers are HF generate's with no_repeat_ngram_size=0"]
    assert preflight.check_job(spec, batch_size=1).notes == tuple(preflight.generate_notes(spec))
    sampling = runspec.RunSpec.from_dict({**spec.to_dict(), "generate": {
        "max_new_tokens": 8, "temperature": 1.0}})
    assert [n.split(" sets ")[1].split("=")[0] for n in preflight.generate_notes(sampling)] \
        == ["repetition_penalty", "no_repeat_ngram_size", "typical_p"]
    followed = runspec.RunSpec.from_dict({**spec.to_dict(), "generate": {
        "max_new_tokens": 8, "repetition_penalty": 1.5}})
    assert [n.split(" sets ")[1].split("=")[0] for n in preflight.generate_notes(followed)] \
        == ["no_repeat_ngram_size"]

    hf = hf_models.load_hf_model(path)
    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                  no_repeat_ngram_size=0)
    differ = 0
    for penalty in (1.0, 1.5):
        config = generate_config.GenerateConfig(max_new_tokens=MAX_NEW,
                                                repetition_penalty=penalty)
        samples = _generator(path, config).run(_prompts())
        for s, prompt in zip(samples, _prompts()):
            ids = torch.tensor(prompt[None].astype(np.int64))
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids),
                              repetition_penalty=penalty, **kwargs)[0, len(prompt):].numpy()
            np.testing.assert_array_equal(s.generated_ids, ref,
                                          err_msg=f"penalty {penalty} prompt {s.prompt_index}")
            if penalty == 1.0:  # HF's own default applies the checkpoint's 1.5
                default = hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                differ += not np.array_equal(default[0, len(prompt):].numpy(), ref)
    assert differ


@pytest.mark.parametrize("arch", ("llama3", "gemma2"))
def test_repetition_penalty_answers_equal_hf_generate(ckpt_dir, arch):
    """With a repetition penalty, greedy ids equal HF generate's with that penalty for
    every prompt (prompt ids penalised too; five prompts on two slots, so a slot's next
    sample must not carry its last one's ids) and differ from the unpenalised ones; the
    activations stay HF's forward over prompt + generated. Sampling with top_k=1 writes the
    same text (the penalty comes before the warpers, as HF's processors)."""
    import torch

    path = ckpt_dir(arch)
    hf = hf_models.load_hf_model(path)
    # Prompts that repeat their ids, so the penalty moves the argmax often.
    prompts = [np.tile(p[:4], 4)[:n] for p, n in zip(_prompts(2), LENGTHS)]
    greedy = _generator(path, generate_config.GenerateConfig(
        max_new_tokens=MAX_NEW, repetition_penalty=3.0)).run(prompts)
    sampled = _generator(path, generate_config.GenerateConfig(
        max_new_tokens=MAX_NEW, repetition_penalty=3.0, temperature=0.8, top_k=1,
        seed=1)).run(prompts)
    moved = 0
    for s, t, prompt in zip(greedy, sampled, prompts):
        ids = torch.tensor(prompt[None].astype(np.int64))
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=MAX_NEW, pad_token_id=0)
        ref = hf.generate(ids, repetition_penalty=3.0, **kwargs)[0, len(prompt):].numpy()
        np.testing.assert_array_equal(s.generated_ids, ref, err_msg=f"prompt {s.prompt_index}")
        np.testing.assert_array_equal(t.generated_ids, ref, err_msg=f"prompt {s.prompt_index}")
        moved += not np.array_equal(ref, _hf_greedy(hf, prompt, MAX_NEW, ()))
        _compare_activations(s, hf)
    assert moved >= 3


@pytest.mark.parametrize("penalty", (0.0, -1.0, float("inf")))
def test_a_bad_repetition_penalty_is_refused_by_name(ckpt_dir, penalty):
    config = generate_config.GenerateConfig(max_new_tokens=4, repetition_penalty=penalty)
    with pytest.raises(generate_config.GenerateError, match="generate.repetition_penalty"):
        _generator(ckpt_dir("qwen2_untied"), config)
