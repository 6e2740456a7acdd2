"""`qkvjax analyze`: the measures against direct float64 computations, the safetensors layouts, qkvjax runs."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from qkvjax import Attention, AttentionConfig
from qkvjax.analyze import (
    MEASURES,
    LayerWeights,
    analyze_layers,
    form_measures,
    head_measures,
    layer_from_params,
    merged_measures,
    principal_cosines,
)
from qkvjax.sources import load_safetensors
from tests.helpers import REPO, metrics, run_in_process, train_args

STRICT_DTYPE_PROMOTION = False  # the training test uses optax

D, N, K, H = 15, 5, 1, 3  # odd and distinct; N H = D so bert and gpt2 weights are square per role
RNG = np.random.default_rng(7)


def _linear(heads):
    """(heads, D, H) -> nn.Linear [heads H, D]."""
    return heads.transpose(0, 2, 1).reshape(-1, heads.shape[1])


@pytest.fixture(autouse=True)
def _fresh_rng():
    """Each test draws from the same seed whatever ran before it (tests are spread over pytest-xdist workers)."""
    global RNG
    RNG = np.random.default_rng(7)


def _heads(n=N, rng=None):
    return (rng or RNG).standard_normal((n, D, H))


def test_form_measures_equal_the_direct_d_by_d_computation():
    pq, pk = _heads(), _heads()
    fast = form_measures(pq, pk)
    slow = merged_measures(pq @ pk.transpose(0, 2, 1))  # the (D, D) forms themselves
    for name in fast:
        np.testing.assert_allclose(fast[name], slow[name], rtol=1e-9, atol=1e-12, err_msg=name)
    # principal cosines against the textbook definition through the SVD bases
    ua = np.linalg.svd(pq, full_matrices=False)[0]
    ub = np.linalg.svd(pk, full_matrices=False)[0]
    want = np.linalg.svd(ua.transpose(0, 2, 1) @ ub, compute_uv=False).mean(-1)
    np.testing.assert_allclose(principal_cosines(pq, pk), want, rtol=1e-10)


def test_known_answers_and_basis_invariance():
    q = _heads()
    a = np.eye(H) + 2 * np.triu(RNG.standard_normal((N, H, H)), 1)  # unit upper triangular: invertible, not symmetric
    same = head_measures(LayerWeights(q=q, k=q, v=_heads()))
    for name in ("qk_cos", "symmetry", "trace_ratio"):
        np.testing.assert_allclose(same[name], 1.0, rtol=1e-9, err_msg=name)
    changed = head_measures(LayerWeights(q=q, k=q @ a, v=q @ a))
    np.testing.assert_allclose(changed["qk_cos"], 1.0, rtol=1e-9)
    np.testing.assert_allclose(changed["kv_cos"], 1.0, rtol=1e-9)
    assert np.all(changed["symmetry"] < 1 - 1e-3)  # a basis change inside a head does move the form's symmetry


def _write(tmp_path, name, tensors, config=None):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, str(path))
    if config is not None:
        (path.parent / "config.json").write_text(json.dumps(config))
    return str(path)


def test_bert_layout_identical_query_and_key(tmp_path):
    q, v = _heads(), _heads()
    tensors = {}
    for i in range(2):
        prefix = f"bert.encoder.layer.{i}.attention.self."
        tensors.update({prefix + "query.weight": _linear(q), prefix + "key.weight": _linear(q),
                        prefix + "value.weight": _linear(v), prefix + "query.bias": np.zeros(D)})  # fmt: skip
    path = _write(tmp_path / "bert", "model.safetensors", tensors, {"num_attention_heads": N})
    layers = load_safetensors(path, "bert")
    assert len(layers) == 2
    np.testing.assert_allclose(layers[0].q, q, rtol=1e-6)  # heads split the output dimension contiguously
    report = analyze_layers(layers, "bert")
    for layer in report["layers"]:
        for name in ("qk_cos", "symmetry", "trace_ratio"):
            assert layer[name] == pytest.approx(1.0, abs=1e-5), name
    with pytest.raises(ValueError, match="--num-heads"):
        load_safetensors(_write(tmp_path / "noconfig", "m.safetensors", tensors), "bert")


def test_gpt2_fused_conv1d_splits_back_into_q_k_v(tmp_path):
    q, k, v = _heads(), _heads(), _heads()
    # Conv1D stores [in, out]: the fused weight is [D, 3 D] = [W_q^T | W_k^T | W_v^T].
    fused = np.concatenate([_linear(q).T, _linear(k).T, _linear(v).T], axis=1)
    path = _write(
        tmp_path, "gpt2.safetensors", {"h.0.attn.c_attn.weight": fused, "h.0.attn.c_attn.bias": np.zeros(3 * D)}
    )
    (layer,) = load_safetensors(path, "gpt2", num_heads=N)
    for got, want in ((layer.q, q), (layer.k, k), (layer.v, v)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn\.weight.*\[D, 3 D\]"):
        load_safetensors(_write(tmp_path, "t.safetensors", {"h.0.attn.c_attn.weight": fused.T}), "gpt2", num_heads=N)


def test_llama_grouped_heads_map_by_group(tmp_path):
    n, k = 6, 2  # G = 3
    d = D
    q = RNG.standard_normal((n, d, H))
    kv = q[:: n // k].copy()  # kv head j equals query head 3 j
    names = {f"model.layers.0.self_attn.{r}_proj.weight": _linear(x) for r, x in (("q", q), ("k", kv), ("v", kv))}
    path = _write(tmp_path / "llama", "m.safetensors", names, {"num_attention_heads": n, "num_key_value_heads": k})
    (layer,) = load_safetensors(path, "llama")
    m = head_measures(layer)
    np.testing.assert_allclose(m["qk_cos"][[0, 3]], 1.0, rtol=1e-6)  # the heads their kv head was copied from
    assert np.all(m["qk_cos"][[1, 2, 4, 5]] < 0.99)
    bad = dict(names)
    bad["model.layers.0.self_attn.k_proj.weight"] = _linear(kv).T  # transposed: [D, K H]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_safetensors(_write(tmp_path / "bad", "m.safetensors", bad), "llama", num_heads=n, num_kv_heads=k)
    with pytest.raises(ValueError, match="not in the bert layout"):  # mislabelled format
        load_safetensors(path, "bert", num_heads=n)


def test_controls_match_an_independent_monte_carlo():
    q, v = _heads(), _heads()
    report = analyze_layers([LayerWeights(q=q, k=q, v=v)], "tied", random_seeds=4)
    rng = np.random.default_rng(123)
    draws = [merged_measures(a @ b.T) for a, b in (rng.standard_normal((2, D, H)) for _ in range(300))]
    expected_sym = np.mean([d["symmetry"] for d in draws])
    cos = np.mean([principal_cosines(*rng.standard_normal((2, D, H))) for _ in range(300)])
    assert report["random"]["symmetry"] == pytest.approx(expected_sym, abs=0.03)
    assert report["random"]["qk_cos"] == pytest.approx(cos, abs=0.05)
    assert report["random"]["qk_cos"] < report["mean"]["qk_cos"] - 0.3  # matched pair: 1
    # mismatched heads of a tied layer: head n's Q against head n+1's (= Q_{n+1}): no longer identical
    assert report["mismatched"]["symmetry"] < 0.9 and report["mismatched"]["qk_cos"] < 0.9


def test_bilinear_reports_its_merged_form():
    cfg = AttentionConfig(num_heads=N, head_dim=H, scheme="bilinear")
    params = Attention(cfg).init(jax.random.key(0), np.zeros((1, 3, D), np.float32))["params"]
    layer = layer_from_params(jax.tree.map(np.asarray, nn.meta.unbox(params)), cfg.tying)
    report = analyze_layers([layer], "bilinear")
    assert report["layers"][0]["qk_cos"] is None and report["max_rank"] == D
    assert 0.3 < report["layers"][0]["symmetry"] < 0.7  # an untrained merged form is not symmetric


def test_shared_qk_run_is_symmetric_separate_is_not(tmp_path, corpus, data_dir):
    runs = {}
    for scheme in ("separate", "shared_qk"):
        w = tmp_path / scheme
        overrides = {"train.num_steps": 2, "model.attention.scheme": scheme, "train.log_weight_similarity": True}
        assert run_in_process(train_args(w, corpus, data_dir, **overrides)) == 0
        out = tmp_path / f"{scheme}.json"
        assert run_in_process(["analyze", f"--workdir={w}", f"--json={out}", f"--plot={tmp_path / scheme}.png"]) == 0
        runs[scheme] = json.loads(out.read_text())
        with open(f"{tmp_path / scheme}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        (ev,) = metrics(w, evals=True)  # the training-time option logged the same measures
        for i, layer in enumerate(runs[scheme]["layers"]):
            assert ev[f"symmetry/layer_{i}"] == pytest.approx(layer["symmetry"], abs=1e-4)
            assert ev[f"qk_cos/layer_{i}"] == pytest.approx(layer["qk_cos"], abs=1e-4)
        drift = runs[scheme]["drift"]  # two AdamW steps moved every kernel away from the seed's initialisation
        for row in drift:  # the training-time log measured the same drift
            for kernel, value in row.items():
                if kernel != "layer":
                    assert ev[f"drift/{kernel}/layer_{row['layer']}"] == pytest.approx(value, rel=1e-4)
        assert len(drift) == len(runs[scheme]["layers"]) and all(
            v > 0 for r in drift for k, v in r.items() if k != "layer"
        )
        assert set(runs[scheme]["initial"]) >= set(MEASURES)
    assert all(layer["symmetry"] == pytest.approx(1.0, abs=1e-6) for layer in runs["shared_qk"]["layers"])
    assert all(layer["symmetry"] < 0.9 for layer in runs["separate"]["layers"])
    assert set(runs["separate"]) >= {"source", "layers", "random", "mismatched"}


def test_an_untrained_run_has_not_drifted_from_its_seed(tmp_path, corpus, data_dir, capsys):
    """One step at a learning rate of 1e-9 (AdamW moves each weight by about that): the weights are still the
    initialisation, which analyze recomputes from the run's seed, so the drift is ~1e-9 (another initialisation
    would give ~1.4) and the measures equal those of W_0."""
    w = tmp_path / "untrained"
    overrides = {"train.num_steps": 1, "train.learning_rate": 1e-9}
    assert run_in_process(train_args(w, corpus, data_dir, **overrides)) == 0
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert run_in_process(["analyze", f"--workdir={w}", f"--json={out}"]) == 0
    assert "relative drift |W - W_0|_F / |W_0|_F:" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert all(v < 1e-6 for r in report["drift"] for k, v in r.items() if k != "layer")
    assert set(report["drift"][0]) == {"layer", "w_q", "w_k", "w_v", "w_o"}
    assert report["drift_decay_only"]["steps"] == 1 and report["drift_decay_only"]["drift"] < 1e-9
    for m in MEASURES:
        if report["mean"][m] is not None:
            assert report["initial"][m] == pytest.approx(report["mean"][m], abs=1e-5)


def test_analyze_cli_errors(tmp_path, capsys):
    assert run_in_process(["analyze"]) == 2
    assert "exactly one of --workdir" in capsys.readouterr().err
    assert run_in_process(["analyze", "--safetensors", str(tmp_path / "x.safetensors"), "--format", "gpt2"]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert run_in_process(["analyze", "--workdir", str(tmp_path), "--json", str(tmp_path / "no" / "r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "no")
    assert run_in_process(["analyze", "--workdir", str(tmp_path), "--num-heads", "3", "--label", "x"]) == 2
    assert "--label, --num-heads go(es) with --safetensors only" in capsys.readouterr().err
    assert run_in_process(["analyze", "--safetensors", str(tmp_path / "x"), "--format", "gpt2", "--step", "5"]) == 2
    assert "--step=5 goes with --workdir only" in capsys.readouterr().err
    not_safetensors = tmp_path / "model.safetensors"  # a file of another kind under the name (a pickle, a text)
    not_safetensors.write_text("this is not a safetensors file\n")
    args = ["analyze", "--safetensors", str(not_safetensors), "--format", "gpt2", "--num-heads", "3"]
    assert run_in_process(args) == 2
    err = capsys.readouterr().err
    assert "is not a readable safetensors file" in err and "Traceback" not in err and err.count("\n") == 1, err
    # 10^12 draws of the random control ran for good (found giving every option odd values, 2026-11-30)
    assert run_in_process(["analyze", "--workdir", str(tmp_path), "--random-seeds", str(10**12)]) == 2
    assert "--random-seeds=1000000000000; allowed: an integer in [1, 1000]" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--random-seeds=2.5; allowed: an integer in \[1, 1000\]"):
        analyze_layers([LayerWeights(q=_heads(), k=_heads(), v=_heads())], "x", random_seeds=2.5)


def test_kv_rank_error_is_the_eckart_young_residual_of_keys_and_values_side_by_side():
    """Against numpy's SVD of [W^K, W^V] laid out (D, K (H + Hv)); zero when K and V live in D/4 dimensions; the
    same from jax arrays; NaN in the mismatched control and for a merged form."""
    d, n, k, h, hv = 20, 6, 3, 5, 7
    q, keys, values = RNG.standard_normal((n, d, h)), RNG.standard_normal((k, d, h)), RNG.standard_normal((k, d, hv))
    layer = LayerWeights(v=values, q=q, k=keys)
    s = np.linalg.svd(np.concatenate([keys.transpose(1, 0, 2).reshape(d, -1), values.transpose(1, 0, 2).reshape(d, -1)],
                                     axis=1), compute_uv=False)  # fmt: skip
    expected = np.sqrt(np.sum(s[d // 4 :] ** 2) / np.sum(s**2))
    got = head_measures(layer)["kv_rank_err"]
    np.testing.assert_allclose(got, np.full(n, expected), rtol=1e-12)
    as_jax = head_measures(LayerWeights(v=jax.numpy.asarray(values), q=jax.numpy.asarray(q), k=jax.numpy.asarray(keys)))
    np.testing.assert_allclose(np.asarray(as_jax["kv_rank_err"]), got, rtol=1e-4)
    basis = RNG.standard_normal((d, d // 4))  # every key and value a combination of D/4 directions
    low = LayerWeights(v=np.einsum("DR,KRV->KDV", basis, RNG.standard_normal((k, d // 4, hv))), q=q,
                       k=np.einsum("DR,KRH->KDH", basis, RNG.standard_normal((k, d // 4, h))))  # fmt: skip
    assert np.max(head_measures(low)["kv_rank_err"]) < 1e-7
    assert np.all(np.isnan(head_measures(layer, shift=1)["kv_rank_err"]))
    merged = LayerWeights(v=values[:1], qk_merged=RNG.standard_normal((2, d, d)))
    assert np.all(np.isnan(head_measures(merged)["kv_rank_err"]))


def test_a_cla_readers_absent_kernels_print_as_a_dash():
    """The committed analysis of a CLA run (layers 1 and 3 read the K/V of 0 and 2): its drift table names every
    kernel any layer has, and a reader's w_k, w_v print as '-', not 'nan'."""
    from qkvjax.analyze import format_report

    report = json.loads((REPO / "experiments/results/mechanisms_cpu/analyze/cla2.json").read_text())
    assert [sorted(r) for r in report["drift"]][1] == ["layer", "w_o", "w_q"]  # a reader has no K/V kernels
    table = format_report(report).split("relative drift |W - W_0|_F / |W_0|_F:\n")[1].splitlines()
    assert table[0].split() == ["layer", "w_k", "w_o", "w_q", "w_v"]
    assert table[2].split()[1] == "-" and table[2].split()[4] == "-" and "nan" not in "".join(table)
    assert all(float(x) > 0.3 for x in table[1].split()[1:])  # a producer's kernels all moved


def test_the_decay_only_control_is_adamws_shrinkage_over_the_schedule():
    """With every gradient zero AdamW's moments stay 0 and each step multiplies a kernel by (1 - lr_t wd): the
    control's drift is 1 - prod_t (1 - lr_t wd), computed here in float64 from the schedule itself."""
    from qkvjax.config import TrainConfig
    from qkvjax.sources import decay_only_drift
    from qkvjax.train.state import learning_rate_schedule

    cfg = TrainConfig(num_steps=37, learning_rate=0.3, warmup_steps=5, weight_decay=0.7, min_lr_ratio=0.1)
    rates = np.array([float(learning_rate_schedule(cfg)(t)) for t in range(29)], np.float64)
    got = decay_only_drift(cfg, 29)
    assert got["steps"] == 29
    assert got["drift"] == pytest.approx(1 - np.prod(1 - rates * cfg.weight_decay), rel=1e-5)
    assert decay_only_drift(dataclasses.replace(cfg, weight_decay=0.0), 29)["drift"] == 0.0  # no decay, no drift
