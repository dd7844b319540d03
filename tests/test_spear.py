"""SPEAR (Dimitrov et al., NeurIPS 2024): a whole batch recovered exactly from a ReLU linear layer's gradient, by
the sparse directions of its rank-b factor."""
import pytest

import gleak


def _spear(batch, seed, **params):
    return gleak.run_trial(attack={"name": "spear", **params}, seed=seed, dataset="skimage", model="mlp",
                           batch_size=batch, check=False)  # fmt: skip


@pytest.mark.parametrize("batch", [2, 4, 8])
def test_spear_recovers_every_sample_of_a_batch_exactly_over_seeds(batch):
    rows = [_spear(batch, seed).row for seed in range(5)]
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    # the batch's MSE (each truth matched to one reconstruction) at float rounding: every sample exact
    assert all(r["mse"] < 1e-12 for r in rows), [r["mse"] for r in rows]
    assert all(r["matched"] == batch for r in rows)


def test_the_papers_sampling_alone_recovers_a_batch_of_8_too():
    # decode_last = false: every direction from sampled submatrices, as the paper's Algorithm 1
    rows = [_spear(8, seed, decode_last=False).row for seed in range(3)]
    assert all(r["mse"] < 1e-12 for r in rows), [r["mse"] for r in rows]


def test_spear_tells_two_samples_with_nearly_the_same_inactive_units_apart():
    """Seed 0 at batch 12 holds two photographs whose inactive units are 129 shared, 13 and 11 their own: a mix of
    their two directions vanishes at the 129 and one more unit, so it looks sparser than five true directions.
    The selection must not take two such mixes for the pair (measured: exact on seeds 0-3)."""
    rows = [_spear(12, seed).row for seed in range(4)]
    assert all(r["mse"] < 1e-12 for r in rows), [r["mse"] for r in rows]


def test_spear_reads_a_secure_sum_of_several_clients_as_one_batch():
    # FedSGD's clients share one model, so the sum of 4 clients' batches of 2 is the gradient of a batch of 8.
    rows = [gleak.run_trial(attack="spear", protocol="secure-aggregation", seed=seed, dataset="skimage", model="mlp",
                            batch_size=2, clients=4).row for seed in range(3)]  # fmt: skip
    assert all(r["mse"] < 1e-12 for r in rows), [r["mse"] for r in rows]


def test_spear_short_of_draws_still_returns_one_input_per_sample_and_says_so():
    result = _spear(8, 0, max_draws=1, draws_per_step=1)
    assert result.status == "ok"
    assert result.reconstruction.shape[0] == 8
    assert result.extra["sparsity_match"] < 0.999 and result.extra["draws"] == 1


def test_spear_needs_a_first_linear_layer():
    result = gleak.run_trial(attack="spear", dataset="skimage", model="convnet", batch_size=2, check=False)
    assert result.status == "not-applicable" and "nn.Linear" in result.error


@pytest.mark.parametrize("params", [{"max_draws": 0}, {"min_sparsity": 1.0}, {"match_done": 0.0}, {"zero_tol": -1.0}])
def test_spear_refuses_parameters_outside_their_range(params):
    with pytest.raises(gleak.InputError):
        gleak.trial_config({"name": "spear", **params})
