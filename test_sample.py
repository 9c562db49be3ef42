"""Tests of the KV-cache decoding path (model.GPT.decode) and of sample.py.

Every expectation comes from a second code path: the model's full forward pass on the whole
sequence (recomputed at each step, no cache), a distribution written out in the test, or the
tokenizer's own decoding of an independently computed greedy continuation.
"""
import dataclasses
import pathlib
import re
import shutil
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model as M
import sample
import train
from core import seeds
from inference import decoding
from layers import attention as A
from layers import loss as loss_lib
from store import rundir
from test_train import corpus, tiny  # noqa: F401  (corpus is a fixture)

REPO = pathlib.Path(__file__).resolve().parent
# vocabulary 200 is padded to 256: the padding rows must never be sampled
TINY = M.GPTConfig(vocab_size=200, block_size=16, embedding_dim=32, num_head=4, N=2)


def sharp_model(cfg, seed=0, scale=0.3):
    """A model with every parameter perturbed, so its next-token distributions are far from uniform."""
    m = M.GPT(cfg, rngs=nnx.Rngs(params=seed))
    state = nnx.state(m)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: np.asarray(a) + rng.normal(0, scale, a.shape).astype(np.float32),
                          nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    nnx.update(m, state)
    return m


def prompts(B, T, vocab=200, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)


def greedy_by_recomputation(m, prompt, n, vocab_size, eot_id=None):
    """n greedy tokens per row, each the argmax of a full forward pass (`GPT.__call__`, no cache) over the
    whole sequence so far.

    The sequence sits in a fixed buffer of its final length, zeros after the tokens so far, so that
    one compiled forward pass serves every step: the model is causal (test_model.test_causal), so the
    logits at position t - 1 are those of the sequence of its first t tokens.
    """
    graphdef, state = nnx.split(m)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    B, T0 = prompt.shape
    seq = np.zeros((B, T0 + n), np.int32)
    seq[:, :T0] = prompt
    for t in range(T0, T0 + n):
        logits = np.asarray(forward(state, jnp.asarray(seq)))[:, t - 1, :vocab_size]  # (B, V) real vocabulary
        seq[:, t] = logits.argmax(-1)
    new = seq[:, T0:]
    if eot_id is not None:
        return [list(row[: list(row).index(eot_id)]) if eot_id in row else list(row) for row in new]
    return new


# ----------------------------------------------------------------------------------------------
# The cache against the full forward pass


@pytest.mark.parametrize("alibi", [True, False])
def test_decode_logits_equal_full_forward(alibi):
    """Prefill 6 tokens, then 3 at once, then one at a time: each position's logits equal the full pass's."""
    cfg = dataclasses.replace(TINY, alibi_attn=alibi)
    m = sharp_model(cfg)
    L = 40 if alibi else 16  # ALiBi beyond block_size 16
    toks = jnp.asarray(prompts(2, L))
    full = np.asarray(m(toks))  # (2, L, 256)
    step = jax.jit(lambda graphdef, state, t, c, pos: nnx.merge(graphdef, state).decode(t, c, pos),
                   static_argnums=0)
    graphdef, state = nnx.split(m)
    cache = M.init_cache(cfg, 2, L)
    assert len(cache["k"]) == len(cache["v"]) == cfg.N
    assert {c.shape for c in cache["k"] + cache["v"]} == {(2, cfg.num_head, L, cfg.head_dim)}
    got = []
    chunks = [(0, 6), (6, 9)] + [(t, t + 1) for t in range(9, L)]
    for a, b in chunks:
        logits, cache = step(graphdef, state, toks[:, a:b], cache, a)
        assert logits.dtype == jnp.float32 and logits.shape == (2, b - a, cfg.padded_vocab_size)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=1e-5, rtol=0)


# the decoder families' layouts (model.py's switches), at TINY's size
LAYOUTS = {
    "alibi": {},
    "learned": dict(alibi_attn=False),
    "gptj": dict(alibi_attn=False, rotary_dim=4, rotary_interleaved=True, residual="parallel_shared",
                 attention_bias=False, tie_embeddings=False, head_bias=True),
    "neox": dict(alibi_attn=False, rotary_dim=4, residual="parallel", gelu_approximate=False, tie_embeddings=False),
    "opt": dict(alibi_attn=False, position_offset=2, activation="relu", mlp_dim=48),
    "llama": dict(alibi_attn=False, rotary_dim=8, norm="rmsnorm", activation="swiglu", num_kv_head=2, bias=False,
                  tie_embeddings=False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_with_a_position_a_row_equals_the_full_forward_of_each_row(layout):
    """Rows prefilled to different lengths, then stepped one token a call, each at its own position (a (B,)
    pos, serve.py's slots): each row's logits equal the full forward pass of that row's own sequence."""
    cfg = dataclasses.replace(TINY, **LAYOUTS[layout])
    m = sharp_model(cfg, seed=2)
    graphdef, state = nnx.split(m)
    B, L = 3, cfg.block_size
    toks = prompts(B, L, seed=5)
    full = np.asarray(m(jnp.asarray(toks)))  # (B, L, V_padded)
    step = jax.jit(lambda state, t, c, pos: nnx.merge(graphdef, state).decode(t, c, pos))
    cache = M.init_cache(cfg, B, L)
    starts = np.array([2, 5, 9])  # row b's prompt: its first starts[b] tokens, prefilled alone
    for b, T0 in enumerate(starts):
        row = {n: tuple(c[b:b + 1] for c in cache[n]) for n in cache}
        logits, row = step(state, jnp.asarray(toks[b:b + 1, :T0]), row, 0)
        np.testing.assert_allclose(np.asarray(logits)[0], full[b, :T0], atol=1e-5, rtol=0)
        cache = {n: tuple(c.at[b].set(r[0]) for c, r in zip(cache[n], row[n])) for n in cache}
    pos = starts.copy()
    for _ in range(L - starts.max()):
        logits, cache = step(state, jnp.asarray(toks[np.arange(B), pos][:, None]), cache, jnp.asarray(pos))
        assert logits.shape == (B, 1, cfg.padded_vocab_size)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[np.arange(B), pos], atol=1e-5, rtol=0)
        pos += 1


@pytest.mark.parametrize("alibi", [True, False])
def test_greedy_generation_equals_argmax_of_recomputation(alibi):
    cfg = dataclasses.replace(TINY, alibi_attn=alibi, embed_norm=alibi)
    m = sharp_model(cfg, seed=3)
    prompt = prompts(2, 5, seed=4)
    n = 35 if alibi else 11  # ALiBi: to 40 tokens with block_size 16; learned positions: to exactly 16
    got = decoding.generate(m, prompt, n, temperature=0.0)
    assert got.shape == (2, n)
    np.testing.assert_array_equal(got, greedy_by_recomputation(m, prompt, n, cfg.vocab_size))


def test_the_decode_loop_never_copies_the_cache():
    """The compiled loop writes each token's keys and values into the cache's buffers in place: no copy in it
    holds a layer's cache (B, K, L, D), or all of them (N, B, K, L, D), in any layout: the attention's products
    read the cache as it lies (a cache laid out (B, L, K, D) was transposed for them every step). Stacking the
    layers in one array and setting each back after its step copied the whole cache several times a token."""
    cfg = dataclasses.replace(TINY, num_head=4, block_size=64)
    graphdef, state = nnx.split(sharp_model(cfg))
    prompt, key = jnp.asarray(prompts(2, 5)), jax.random.PRNGKey(0)
    gen = decoding.Generation(graphdef, cfg, 33, temperature=1.0).compile(state, prompt, key)
    L = 5 + 33 - 1
    layer = [cfg.kv_heads, L, cfg.head_dim]
    pattern = r"= \w+\[([\d,]*)\][^ ]* copy\("  # the shape of each copy in XLA's HLO text
    assert re.findall(pattern, "%copy.5 = f32[1,37,4,8]{3,2,1,0} copy(%param.2)") == ["1,37,4,8"]
    hlo = gen.resume.as_text()
    every = [[int(n) for n in re.findall(r"\d+", shape) if n != "1"] for shape in re.findall(r"= \w+\[([\d,]*)\]", hlo)]
    assert [2] + layer in every  # the real text's shapes read as the pattern reads them: the cache's among them
    copied = [list(map(int, re.findall(r"\d+", shape))) for shape in re.findall(pattern, hlo)]
    whole = [c for c in copied if sorted(n for n in c if n != 1) in
             [sorted(s) for s in (layer, [cfg.N] + layer, [2] + layer, [cfg.N, 2] + layer)]]
    assert whole == []
    carry = gen.resume(state, gen.start(state, prompt, key), jnp.int32(33))  # and it still runs
    assert int(carry["i"]) == 33


@pytest.mark.parametrize("N,dtype,samples,prompt,new", [(2, "float32", 2, 8, 200), (4, "bfloat16", 3, 40, 60)])
def test_the_memory_guard_counts_what_the_compiled_generation_holds(N, dtype, samples, prompt, new):
    """generation_bytes, what the guard refuses a request by, is at least what XLA's memory analysis of the
    compiled prefill and loop says they hold beyond the weights (arguments, outputs and temporaries, a
    donated cache counted once), and not more than twice it (a guard that refuses what fits is wrong too)."""
    cfg = dataclasses.replace(TINY, N=N, dtype=dtype, block_size=512)
    graphdef, state = nnx.split(sharp_model(cfg))
    key = jax.random.PRNGKey(0)
    gen = decoding.Generation(graphdef, cfg, new).compile(state, jnp.asarray(prompts(samples, prompt)), key)
    weights = sum(x.nbytes for x in jax.tree.leaves(state))
    held = []
    for phase in (gen.start, gen.resume):
        a = phase.memory_analysis()
        held.append(a.argument_size_in_bytes - weights + a.output_size_in_bytes - a.alias_size_in_bytes
                    + a.temp_size_in_bytes)
    counted = decoding.generation_bytes(cfg, samples, prompt, new)
    assert max(held) <= counted <= 2 * max(held), (held, counted)


def test_learned_positions_refuse_a_cache_beyond_block_size():
    m = sharp_model(dataclasses.replace(TINY, alibi_attn=False))
    with pytest.raises(ValueError, match="block_size 16"):
        m.decode(jnp.asarray(prompts(1, 4)), M.init_cache(m.config, 1, 17), 0)


def test_training_forward_unchanged_by_the_refactor():
    """__call__ still equals attention written out from the weights (one block, by hand, float64)."""
    cfg = dataclasses.replace(TINY, N=1)
    m = sharp_model(cfg, seed=5)
    toks = prompts(1, 12, seed=6)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(m)))

    def ln(x, q):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg.layer_norm_epsilon) * q["scale"] + q["bias"]

    b = p["blocks"][0]
    x = p["wte"][toks[0]]  # (T, d)
    h = ln(x, b["ln_1"])
    qkv = np.einsum("td,dshc->tshc", h, b["attn"]["c_attn"]["kernel"]) + b["attn"]["c_attn"]["bias"]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # (T, H, D)
    T, H, D = q.shape
    slopes = A.alibi_slopes(H).astype(np.float64)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D) - slopes[:, None, None] * (i - j)
    s = np.where(j <= i, s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    y = np.einsum("hqk,khd->qhd", a, v)
    x = x + np.einsum("thc,hcd->td", y, b["attn"]["c_proj"]["kernel"]) + b["attn"]["c_proj"]["bias"]
    h = ln(x, b["ln_2"]) @ b["mlp"]["c_fc"]["kernel"] + b["mlp"]["c_fc"]["bias"]
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    x = x + h @ b["mlp"]["c_proj"]["kernel"] + b["mlp"]["c_proj"]["bias"]
    expected = ln(x, p["ln_f"]) @ p["wte"].T  # (T, V_padded)
    V = cfg.vocab_size
    got = np.asarray(m(jnp.asarray(toks)))[0]
    np.testing.assert_allclose(got[:, :V], expected[:, :V], atol=2e-4, rtol=1e-4)
    assert (got[:, V:] == loss_lib.PADDED_LOGIT).all() and loss_lib.PADDED_LOGIT < -1e8  # the padding rows: never chosen


# ----------------------------------------------------------------------------------------------
# Sampling


def test_padded_vocabulary_is_never_sampled():
    # padding rows with large random embeddings: unmasked, about half of all draws would land there
    m = sharp_model(TINY, seed=7)
    m.wte[...] = jnp.asarray(m.wte[...]).at[TINY.vocab_size:].set(
        5.0 * jax.random.normal(jax.random.key(0), (TINY.padded_vocab_size - TINY.vocab_size, TINY.embedding_dim)))
    out = decoding.generate(m, np.tile(prompts(1, 3), (64, 1)), 20, temperature=10.0, seed=1)
    assert out.min() >= 0 and out.max() < TINY.vocab_size
    assert len(np.unique(out)) > 100  # a high temperature does spread over the real vocabulary
    # and directly: padded logits far above the rest, greedy and sampled alike
    logits = jnp.concatenate([jnp.zeros((500, 200)), jnp.full((500, 56), 100.0)], axis=1)
    for t in (0.0, 1.0, 50.0):
        tok = decoding.sample_logits(logits, jax.random.key(2), vocab_size=200, temperature=t)
        assert int(tok.max()) < 200


def test_top_k_and_top_p_keep_the_right_tokens():
    # probabilities 0.5, 0.3, 0.15, 0.05 over a vocabulary of 4 (padded to 8)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.tile(jnp.asarray(np.concatenate([np.log(p), np.zeros(4)]), jnp.float32), (20000, 1))
    draw = lambda **kw: np.asarray(decoding.sample_logits(logits, jax.random.key(0), vocab_size=4, **kw))  # noqa: E731
    cases = [(dict(top_p=0.7), [0, 1]),  # 0.5 < 0.7, 0.5 + 0.3 reaches it
             (dict(top_p=0.85), [0, 1, 2]),
             (dict(top_p=0.5), [0]),  # the first token alone reaches 0.5
             (dict(top_k=2), [0, 1]),
             (dict(top_k=3, top_p=0.7), [0, 1]),
             (dict(), [0, 1, 2, 3])]
    for kw, kept in cases:
        tokens = draw(temperature=1.0, **kw)
        counts = np.bincount(tokens, minlength=8)
        assert sorted(np.flatnonzero(counts)) == kept, kw
        expected = p[kept] / p[kept].sum()  # renormalised over the kept tokens
        np.testing.assert_allclose(counts[kept] / len(tokens), expected, atol=0.015)
    # temperature 2 flattens: probabilities proportional to p^(1/2)
    counts = np.bincount(draw(temperature=2.0), minlength=8)[:4]
    np.testing.assert_allclose(counts / counts.sum(), np.sqrt(p) / np.sqrt(p).sum(), atol=0.015)


def test_top_k_1_is_greedy_and_seeds_are_reproducible():
    m = sharp_model(TINY, seed=8)
    prompt = np.tile(prompts(1, 4, seed=9), (4, 1))
    greedy = decoding.generate(m, prompt, 20, temperature=0.0)
    np.testing.assert_array_equal(decoding.generate(m, prompt, 20, temperature=1.5, top_k=1, seed=3), greedy)
    a = decoding.generate(m, prompt, 20, temperature=1.0, seed=11)
    b = decoding.generate(m, prompt, 20, temperature=1.0, seed=11)
    c = decoding.generate(m, prompt, 20, temperature=1.0, seed=12)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert len({tuple(row) for row in a}) > 1  # the samples of one batch differ from each other


def test_seeds_that_differ_above_32_bits_give_other_keys():
    """jax.random.key keeps a Python int's low 32 bits (64-bit integers off): seeds 7 and 2**32 + 7 were one
    key, so one set of samples (and of initial weights, and dropout). seeds.key_of keeps JAX's own key where
    JAX takes the seed whole (runs and samples made with those seeds unchanged) and gives every other 64-bit
    seed its own."""
    data = lambda key: tuple(np.asarray(jax.random.key_data(key)).tolist())  # noqa: E731
    for s in (0, 7, 2**31, 2**32 - 1, -5, -2**31):
        assert data(seeds.key_of(s)) == data(jax.random.key(s))
    wide = [7, 2**32 + 7, 2**40 + 7, 2**63 - 1, -2**31 - 1, -2**40 + 7, -2**63]
    assert len({data(seeds.key_of(s)) for s in wide}) == len(wide)
    m = sharp_model(TINY, seed=8)
    prompt = np.tile(prompts(1, 4, seed=9), (4, 1))
    assert (decoding.generate(m, prompt, 20, seed=7) != decoding.generate(m, prompt, 20, seed=2**32 + 7)).any()


def test_generation_stops_at_end_of_text():
    m = sharp_model(TINY, seed=10)
    prompt = prompts(3, 4, seed=11)
    free = decoding.generate(m, prompt, 12, temperature=0.0)
    eot = int(free[0, 4])  # pretend the token greedy decoding produces 5th in row 0 is end-of-text
    out = decoding.generate(m, prompt, 12, temperature=0.0, eot_id=eot)
    for free_row, row in zip(free, out):
        cut = list(free_row).index(eot) if eot in free_row else len(free_row)
        np.testing.assert_array_equal(row[:cut + 1], free_row[:cut + 1])
        assert (row[cut:] == eot).all()
        assert decoding.truncate(row, eot) == list(free_row[:cut])


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=1.0, top_k=50, top_p=0.9)])
def test_generation_in_chunks_equals_one_loop(settings):
    """The loop run a chunk of steps at a time (sample.py's way, to show progress and stop on Ctrl-C) gives
    the tokens of the one-call loop, greedy and sampled with the same key, rows ending at end-of-text at
    different steps included: after every chunk, the tokens so far are the start of the one call's."""
    m = sharp_model(TINY, seed=12)
    graphdef, state = nnx.split(m)
    prompt, key = jnp.asarray(prompts(3, 5, seed=13)), jax.random.key(5)
    free, _ = decoding.make_generate(graphdef, TINY, 30, **settings)(state, prompt, key)
    eot = int(np.asarray(free)[1, 12])  # a token of row 1: rows end at different steps, or not at all
    generation = decoding.make_generate(graphdef, TINY, 30, eot_id=eot, **settings)
    whole, steps = generation(state, prompt, key)
    whole, steps = np.asarray(whole), int(steps)
    assert (whole == eot).any() and 1 < steps
    for first, seconds in ((1, 0.0), (4, 1e9)):  # a step per chunk; chunks of 4, 16, ... steps
        sizes, last = [], 0
        for done in generation.chunks(state, prompt, key, first=first, seconds=seconds):
            np.testing.assert_array_equal(done.tokens(), whole[:, :done.steps])
            sizes.append(done.steps - last)
            last = done.steps
        assert done.ended and done.steps == steps
        expected, size = [1], first  # the prefill's token, then chunks growing at most 4-fold to the end
        while sum(expected) < steps:
            expected.append(min(size, steps - sum(expected)))
            size = size if seconds == 0 else 4 * size
        assert sizes == expected, sizes


# ----------------------------------------------------------------------------------------------
# The command line on trained runs


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    """Two 4-step runs of the `test` size (block_size 64): ALiBi, and learned positions."""
    root = tmp_path_factory.mktemp("sample_runs")
    extra = ("training.steps=4", "checkpoint.every=4", "training.eval_every=4")
    assert train.main(tiny(root / "alibi", corpus, *extra)) == 0
    assert train.main(tiny(root / "learned", corpus, "model.alibi_attn=false", "model.embed_norm=false", *extra)) == 0
    return root


def run_cli(capsys, *argv):
    rc = sample.cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_greedy_continues_the_prompt_past_the_context(runs, capsys):
    from tokenizers import Tokenizer

    run_dir = runs / "alibi"
    prompt = "the cat sat on"
    rc, out, err = run_cli(capsys, "--checkpoint", run_dir, "--prompt", prompt, "--max-new-tokens", 80,
                           "--temperature", 0, "--num-samples", 2)
    assert rc == 0
    texts = [block.split("\n", 1)[1].rstrip("\n") for block in out.split("---------- sample ")[1:]]
    assert len(texts) == 2 and all(t.startswith(prompt) for t in texts)
    assert texts[0] == texts[1]  # greedy: both samples alike
    assert "new tokens/s" in err
    # the same text from the full forward pass recomputed at every step (64 + ... : beyond block_size 64)
    m, _ = rundir.Run(run_dir).weights.load_model()
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    new = greedy_by_recomputation(m, np.asarray([ids], np.int32), 80, m.config.vocab_size,
                                  eot_id=tok.token_to_id("<|endoftext|>"))[0]
    assert len(ids) + len(new) > m.config.block_size  # no end-of-text before the context is passed
    assert texts[0] == tok.decode(ids + [int(t) for t in new])


def test_cli_sampling_learned_positions(runs, capsys):
    run_dir = runs / "learned"
    args = ["--checkpoint", run_dir, "--prompt", "a big red", "--max-new-tokens", 30, "--temperature", 1.2,
            "--top-k", 50, "--top-p", 0.95, "--seed", 4, "--num-samples", 3]
    rc, out, _ = run_cli(capsys, *args)
    assert rc == 0 and out.count("---------- sample ") == 3
    assert all(block.split("\n", 1)[1].startswith("a big red") for block in out.split("---------- sample ")[1:])
    assert run_cli(capsys, *args)[1] == out  # same seed, same samples


def test_cli_errors_are_one_line(runs, capsys, tmp_path):
    alibi, learned = runs / "alibi", runs / "learned"
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(alibi / "config.yaml", no_ckpt / "config.yaml")
    shutil.copy(alibi / "tokenizer.json", no_ckpt / "tokenizer.json")
    cases = [
        (["--checkpoint", tmp_path / "missing", "--prompt", "the"], "not found"),
        (["--checkpoint", tmp_path, "--prompt", "the"], "not a run directory"),
        (["--checkpoint", no_ckpt, "--prompt", "the"], "no checkpoint"),
        (["--checkpoint", alibi, "--prompt", "the", "--step", 3], "no checkpoint for step 3"),
        (["--checkpoint", alibi, "--prompt", ""], "empty"),
        (["--checkpoint", learned, "--prompt", "the cat", "--max-new-tokens", 63], "block_size 64"),
        (["--checkpoint", alibi, "--prompt", "the", "--top-p", 0], "--top-p"),
        (["--checkpoint", alibi, "--prompt", "the", "--temperature", -1], "--temperature"),
        (["--checkpoint", alibi, "--prompt", "the", "--num-samples", 0], "--num-samples"),
        (["--checkpoint", alibi, "--prompt", "the", "--max-new-tokens", "ten"], "--max-new-tokens"),
        (["--checkpoint", alibi, "--prompt", "the", "--seed", 2**70], "--seed must be a 64-bit integer"),
        (["--checkpoint", alibi, "--prompt", "the", "--seed", 2**63], "--seed must be a 64-bit integer"),
        (["--checkpoint", alibi, "--prompt", "the", "--max-new-tokens", 2**31], "past the 2**31 a model addresses"),
        (["--checkpoint", alibi, "--prompt", "the", "--max-new-tokens", 2**31 - 10], "for the KV cache and the prompt's prefill"),
        (["--checkpoint", alibi, "--prompt", "the", "--num-samples", 10**12], "for the KV cache and the prompt's prefill"),
    ]
    for argv, words in cases:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and out == "", argv
        assert err.count("\n") == 1 and err.startswith("error: ") and words in err, (argv, err)


def test_the_memory_guard_reads_the_processs_own_limit(runs):
    """Under `ulimit -v` (and likewise a cgroup's limit) a prompt whose prefill fits this machine's memory but
    not the process's address space is refused in one line naming that limit (it ran out of memory in XLA
    with RESOURCE_EXHAUSTED and a traceback): the guard takes the smaller of the machine's memory and what
    the process may still map."""
    run_dir = runs / "alibi"
    cfg = rundir.Run(run_dir).record.config().model
    tokenizer = rundir.Run(run_dir).record.tokenizer()
    limit = 8_000_000  # KiB of address space: JAX starts, and leaves a few GiB
    words = "the cat sat on the mat. "
    per = len(tokenizer.encode(words * 100, add_special_tokens=False).ids) / 100
    prompt = words * int(14_000 / per)  # a prefill of about 9 GiB: within the machine's memory, past the limit
    tokens = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
    needed = decoding.generation_bytes(cfg, 1, tokens, 10)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert limit * 1024 < needed < physical - 4 * 2**30, (needed, physical)
    done = subprocess.run(["bash", "-c", f'ulimit -v {limit}; exec "$0" sample.py --checkpoint "$1" --prompt "$2" '
                           f'--max-new-tokens 10', sys.executable, str(run_dir), prompt],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "of the address space this process may still map (ulimit -v) beside the weights" in done.stderr


def test_a_generation_larger_than_memory_is_refused_naming_what_fits(runs, capsys, monkeypatch):
    """--max-new-tokens 1e9 (a 1.5 TB cache on the default model), --num-samples 1e6, or a prompt whose prefill
    (attention scores over the whole prompt, one layer at a time) does not fit: refused before the model
    loads, naming the most new tokens, samples or prompt tokens that fit with the rest as asked; that much
    runs. The device's memory is set here to the weights plus what 3 samples of 40 new tokens need (plus a
    little), so the numbers do not depend on the machine; what fits is found here by trying every value."""
    run_dir = runs / "alibi"
    cfg = rundir.Run(run_dir).record.config().model
    assert (cfg.N, cfg.num_head, cfg.kv_heads, cfg.head_dim, cfg.embedding_dim, cfg.ffn_dim, cfg.dtype) == \
        (2, 4, 4, 8, 32, 128, "float32")  # the test size
    tokenizer = rundir.Run(run_dir).record.tokenizer()
    prompt = len(tokenizer.encode("the", add_special_tokens=False).ids)
    weights = M.param_count(cfg) * 4

    def need(samples, prompt, new):  # held against XLA's memory analysis in the test above
        return decoding.generation_bytes(cfg, samples, prompt, new)

    def most_of(fits, below):  # counting up from 1 while it fits (the need grows with each)
        n = 0
        while n + 1 < below and fits(n + 1):
            n += 1
        return n

    def fits(samples, prompt, new):  # the most of each that fits, the other two as asked
        most = [most_of(lambda n: need(samples, prompt, n) <= room, new),
                most_of(lambda b: need(b, prompt, new) <= room, samples),
                most_of(lambda t: need(samples, t, new) <= room, prompt)]
        named = [f"--max-new-tokens {most[0]:,}", f"--num-samples {most[1]:,}", f"a prompt of {most[2]:,} tokens"]
        return " or ".join(text for text, m in zip(named, most) if m >= 1)

    def refusal(samples, prompt, new):
        return (f"error: --num-samples {samples:,} x (prompt {prompt:,} + --max-new-tokens {new:,}) needs "
                f"{need(samples, prompt, new) / 2**30:,.1f} GiB for the KV cache and the prompt's prefill, more than "
                f"the {room / 2**30:,.1f} GiB of this machine's memory beside the weights ({weights / 2**30:,.1f} "
                f"GiB); at most {fits(samples, prompt, new)} fits\n")

    room = need(3, prompt, 40) + 100
    monkeypatch.setattr(decoding, "device_memory", lambda: (weights + room, "this machine's memory"))
    rc, _, err = run_cli(capsys, "--checkpoint", run_dir, "--prompt", "the", "--max-new-tokens", 10**9,
                         "--num-samples", 3, "--temperature", 0)
    assert fits(3, prompt, 10**9) == "--max-new-tokens 40"  # not one sample of 1e9 tokens: only the length
    assert rc == 2 and err == refusal(3, prompt, 10**9), err
    rc, out, _ = run_cli(capsys, "--checkpoint", run_dir, "--prompt", "the", "--max-new-tokens", 40,
                         "--num-samples", 3, "--temperature", 0)
    assert rc == 0 and out.count("---------- sample ") == 3
    rc, _, err = run_cli(capsys, "--checkpoint", run_dir, "--prompt", "the", "--num-samples", 10**6)
    assert rc == 2 and err == refusal(10**6, prompt, 100), err

    # a long prompt: its prefill's attention grows with its square; 1,000 tokens and 100 new ones fit
    long_prompt = "the cat sat on the mat. " * 400
    tokens = len(tokenizer.encode(long_prompt, add_special_tokens=False).ids)
    room = need(1, 1000, 100) + 10
    assert tokens > 1000 and need(1, tokens, 1) > room  # not even one new token after the whole prompt
    rc, _, err = run_cli(capsys, "--checkpoint", run_dir, "--prompt", long_prompt)
    assert fits(1, tokens, 100) == "a prompt of 1,000 tokens"
    assert rc == 2 and err == refusal(1, tokens, 100), err


def help_entries(parse_args, capsys) -> dict[str, str]:
    """`--help` of a parser, as {option or positional: its help text on one line}."""
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--help"])
    assert stopped.value.code == 0
    body = capsys.readouterr().out.split("\n\n", 1)[1]  # after the usage
    indented = "\n".join(line for line in body.splitlines() if line.startswith(" "))  # no description, headers
    entries = re.split(r"\n  (?=\S)", "\n" + indented)
    return {entry.split()[0]: " ".join(entry.split()[1:]) for entry in entries if entry.strip()}


def assert_help_shows_defaults(parse_args, required: list[str], capsys) -> None:
    """Every option whose parsed default is a value (not None, not a flag's False) names it in --help."""
    parsed = vars(parse_args(required))
    entries = help_entries(parse_args, capsys)
    shown = 0
    for dest, value in parsed.items():
        option = "--" + dest.replace("_", "-")
        if value is None or value is False or option in required:
            continue
        assert f"(default: {value})" in entries[option], (option, entries[option])
        shown += 1
    assert shown >= 3


def test_help_shows_the_defaults(capsys):
    assert_help_shows_defaults(sample.parse_args, ["--checkpoint", "RUN", "--prompt", "x"], capsys)


def test_cli_process_exit_status(tmp_path):
    r = subprocess.run([sys.executable, "sample.py", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])  # (SIGHUP's moments: test_cli.py)
def test_ctrl_c_stops_a_generation_and_prints_what_it_made(runs, sig):
    """A long generation on a terminal shows its progress (tokens, tokens/s) once it has run a few seconds;
    a Ctrl-C (or SIGTERM, or SIGHUP: the terminal closed) then stops it after its chunk, prints the samples as
    far as they got, and ends with one line saying where, status 128 + N (SIGTERM and SIGHUP killed it with no
    line and nothing printed). After a SIGHUP the line goes nowhere, as the terminal it was for is gone; the
    samples, to a pipe, still come. What is printed is the greedy continuation of that many tokens: the one
    loop's (shown equal to the full forward pass recomputed at every step above), run here to that step at once."""
    import fcntl
    import os
    import pty
    import select
    import signal
    import struct
    import termios

    sig = getattr(signal, sig)

    from tokenizers import Tokenizer

    run_dir, prompt = runs / "alibi", "the cat"
    terminal, end = pty.openpty()
    fcntl.ioctl(end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    p = subprocess.Popen([sys.executable, "sample.py", "--checkpoint", str(run_dir), "--prompt", prompt,
                          "--max-new-tokens", "30000", "--temperature", "0"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=end, text=True)
    os.close(end)
    shown, sent, deadline = b"", False, time.monotonic() + 600  # (a guard against a Ctrl-C not heeded)
    try:
        while time.monotonic() < deadline:
            if select.select([terminal], [], [], 1.0)[0]:
                try:
                    chunk = os.read(terminal, 65536)
                except OSError:  # the command has ended: its side of the terminal is closed
                    break
                if not chunk:
                    break
                shown += chunk
            if not sent and b"token/s" in shown:  # the progress bar
                p.send_signal(sig)
                sent = True
            assert sent or p.poll() is None, shown  # no end-of-text before: still generating
        out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        p.kill()
        os.close(terminal)
    said = shown.decode().replace("\r\n", "\n").split("\r")[-1]  # after the bar, cleared
    assert p.returncode == 128 + sig, shown
    how = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
    made = re.fullmatch(rf"\s*error: {how} after (\d+) of --max-new-tokens 30,000 new tokens a sample: the "
                        r"samples above are what was generated\n", said)
    if sig == signal.SIGHUP:  # the line went nowhere; the samples came, the prompt continued
        assert "error:" not in said and "Traceback" not in said, said
        assert out.startswith(f"---------- sample 1/1 ----------\n{prompt}") and len(out) > 100, out[:200]
        return
    assert made, said
    n = int(made.group(1))
    m, _ = rundir.Run(run_dir).weights.load_model()
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    graphdef, state = nnx.split(m)
    gen = decoding.Generation(graphdef, m.config, 30000, temperature=0, eot_id=tok.token_to_id("<|endoftext|>"))
    prompt_ids, key = jnp.asarray([ids], jnp.int32), jax.random.key(0)
    new = np.asarray(gen.resume(state, gen.start(state, prompt_ids, key), jnp.int32(n))["out"])[0, :n]
    assert out == f"---------- sample 1/1 ----------\n{tok.decode(ids + [int(t) for t in new])}\n"


def test_output_to_a_pipe_closed_early_ends_quietly(runs):
    """`python sample.py ... | head -c 600`: the reader has gone before the samples are written; the
    command ends as a Unix tool killed by SIGPIPE does (status 141), with nothing on stderr."""
    p = subprocess.Popen([sys.executable, "sample.py", "--checkpoint", str(runs / "alibi"), "--prompt", "the",
                          "--max-new-tokens", "5"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader gone (head has what it wanted)
    err = p.stderr.read()
    assert (p.wait(timeout=120), err) == (141, b"")


def test_a_prompt_that_is_not_utf8_is_one_line(runs):
    """Bytes on the command line that are not UTF-8 (Latin-1 here) reach Python as lone surrogates, which no
    tokenizer takes: one line naming the first such byte, before anything loads."""
    r = subprocess.run([sys.executable, "sample.py", "--checkpoint", str(runs / "alibi"), "--prompt",
                        b"caf\xe9 au lait"],
                       cwd=REPO, capture_output=True, timeout=120)
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr == (b"error: --prompt is not UTF-8 text (byte 0xe9 at byte 3): give it in UTF-8 (iconv converts "
                        b"from other encodings)\n")
