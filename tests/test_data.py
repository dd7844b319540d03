import pytest
import torch

import gleak
from gleak.contracts.errors import DatasetMissing, InputError
from gleak.mechanics.data import load_dataset, sample_indices


def test_embedded_default_is_real_colour_32x32_with_labels():
    tr, te = load_dataset("skimage"), load_dataset("skimage", "test")
    assert tr.x.shape[1:] == (3, 32, 32) and len(tr) + len(te) == 250 and tr.num_classes == 10
    assert tr.x.min() >= 0 and tr.x.max() <= 1 and tr.x.std() > 0.1
    assert torch.bincount(tr.y).tolist() == [20] * 10


def test_resolution_and_channels():
    ds = load_dataset("skimage", resolution=16, channels=1)
    assert ds.x.shape[1:] == (1, 16, 16)


def test_fashion_mnist_missing_root_names_the_file(tmp_path):
    with pytest.raises(DatasetMissing, match="train-images-idx3-ubyte.gz not found"):
        load_dataset("fashion-mnist", root=str(tmp_path))


def test_fashion_mnist_from_debian_when_installed():
    from gleak.mechanics.data import FASHION_MNIST_DEFAULT

    if not (FASHION_MNIST_DEFAULT / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("dataset-fashion-mnist is not installed (apt-get install -y dataset-fashion-mnist)")
    tr, te = load_dataset("fashion-mnist"), load_dataset("fashion-mnist", "test")
    assert tr.x.shape == (60000, 1, 28, 28) and te.x.shape == (10000, 1, 28, 28)
    assert torch.bincount(tr.y).tolist() == [6000] * 10


def test_image_folder_keeps_its_size_and_resizes_when_asked(tmp_path):
    for c in ("cats", "dogs"):
        (tmp_path / c / "nested").mkdir(parents=True)
        for i in range(3):
            _png(tmp_path / c / f"{i}.png", 40, 50, i)
        _png(tmp_path / c / "nested" / "deep.png", 40, 50, 9)  # class sub-folders are searched recursively
    ds = load_dataset(f"folder:{tmp_path}")
    te = load_dataset(f"folder:{tmp_path}", "test")
    assert ds.classes == ("cats", "dogs") and ds.x.shape[1:] == (3, 40, 50)
    assert len(ds) + len(te) == 8
    assert load_dataset(f"folder:{tmp_path}", resolution=16).x.shape[1:] == (3, 16, 16)


def test_image_folder_of_different_sizes_asks_for_a_resolution(tmp_path):
    (tmp_path / "a").mkdir()
    _png(tmp_path / "a" / "0.png", 40, 40, 0)
    _png(tmp_path / "a" / "1.png", 30, 30, 1)
    with pytest.raises(InputError, match="differ in size.*set resolution"):
        load_dataset(f"folder:{tmp_path}")
    assert load_dataset(f"folder:{tmp_path}", resolution=8).x.shape[1:] == (3, 8, 8)


def test_image_folder_with_train_and_test_roots(tmp_path):
    """The CIFAR-as-PNG layout: PATH/train/CLASS/*.png and PATH/test/CLASS/*.png are the splits, at 64x64; the
    test split takes the train split's class indices even where it lacks a class."""
    for split, n in (("train", 3), ("test", 2)):
        for c in ("airplane", "bird", "cat"):
            if split == "test" and c == "bird":
                continue
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                _png(tmp_path / split / c / f"{i}.png", 64, 64, hash((split, c, i)) % 1000)
    tr, te = load_dataset(f"folder:{tmp_path}"), load_dataset(f"folder:{tmp_path}", "test")
    assert tr.x.shape == (9, 3, 64, 64) and te.x.shape == (4, 3, 64, 64)
    assert tr.classes == te.classes == ("airplane", "bird", "cat")
    assert tr.y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and te.y.tolist() == [0, 0, 2, 2]
    (tmp_path / "test" / "dog").mkdir()
    _png(tmp_path / "test" / "dog" / "0.png", 64, 64, 5)
    from gleak.mechanics import data

    data._raw.cache_clear()
    with pytest.raises(DatasetMissing, match="dog are not in train"):
        load_dataset(f"folder:{tmp_path}", "test")


def test_image_folder_missing_or_empty_is_dataset_missing(tmp_path):
    with pytest.raises(DatasetMissing, match="no such folder"):
        load_dataset(f"folder:{tmp_path / 'nope'}")
    with pytest.raises(DatasetMissing, match="expected PATH/CLASS"):
        load_dataset(f"folder:{tmp_path}")


def test_missing_cifar10_names_the_layout_expected(tmp_path):
    with pytest.raises(DatasetMissing, match=r"cifar-10-batches-py/ with data_batch_1 \.\.\. data_batch_5 and test_batch"):
        load_dataset("cifar10", root=str(tmp_path))


# Digests of the embedded data set as published (commit 30b5d3c): the default 32-px crops must not move, or every
# shipped suite's numbers would.
SKIMAGE_32 = {"train": "9a9287bbbe81015b", "test": "d0dee30b9cb95e43"}


@pytest.mark.parametrize("resolution", [None, 32])
def test_embedded_32px_images_are_byte_identical_to_the_published_ones(resolution):
    import hashlib

    for split, digest in SKIMAGE_32.items():
        x = load_dataset("skimage", split, resolution=resolution).x
        assert hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16] == digest


def test_embedded_images_are_cut_at_the_resolution_asked_not_upsampled():
    from gleak.mechanics.data import _resize

    big = load_dataset("skimage", resolution=64).x
    upsampled = _resize(load_dataset("skimage").x, 64)

    def detail(x):  # mean absolute difference of neighbouring pixels: what an upsampling smooths away
        return float((x[..., 1:] - x[..., :-1]).abs().mean())

    assert big.shape == upsampled.shape == (200, 3, 64, 64)
    assert detail(big) > 1.2 * detail(upsampled)
    # and the same picture: brought back to 32 px it is close to the published crops
    assert float((_resize(big, 32) - load_dataset("skimage").x).abs().mean()) < 0.02


def test_register_dataset_adds_a_name_and_list_datasets_shows_it():
    from gleak.mechanics.data import DataRequest, list_datasets, register_dataset

    @register_dataset("test-stripes", "vertical stripes (a test)")
    def _stripes(req: DataRequest):
        n = 10
        x = torch.zeros(n, 1, 6, 6)
        x[:, :, :, ::2] = 1.0
        return x, torch.arange(n) % 2, ("even", "odd"), torch.arange(n) % 5 == 2

    assert ("test-stripes", "vertical stripes (a test)") in list_datasets()
    ds = load_dataset("test-stripes", resolution=12, channels=3)
    assert ds.x.shape == (8, 3, 12, 12) and ds.classes == ("even", "odd")
    with pytest.raises(InputError, match="registered twice"):
        register_dataset("test-stripes")(lambda req: None)


def _png(path, h, w, seed):
    import numpy as np
    from PIL import Image

    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(path)


def test_unknown_dataset_suggests():
    with pytest.raises(InputError, match="did you mean 'skimage'"):
        load_dataset("skimag")


def test_distinct_label_batches():
    ds = load_dataset("skimage")
    idx = sample_indices(len(ds), ds.y, 8, torch.Generator().manual_seed(0), distinct_labels=True)
    assert len(set(ds.y[idx].tolist())) == 8


def test_iid_client_shards_are_those_of_the_utility_loop_before():
    from gleak.contracts.seeds import generator
    from gleak.mechanics.data import client_shards

    labels = torch.arange(103) % 7
    got = client_shards(labels, 4, generator(3, "utility-shards"))
    perm = torch.randperm(103, generator=generator(3, "utility-shards"))  # the loop's IID rule (commit 30b5d3c)
    assert [s.tolist() for s in got] == [perm[i * 25 : (i + 1) * 25].tolist() for i in range(4)]


def _skew(shards, labels):
    """Mean over clients of the share of its samples in its most common class (1/classes when IID, 1 when one class)."""
    return sum(float(torch.bincount(labels[s]).max()) / len(s) for s in shards) / len(shards)


def test_dirichlet_shards_partition_the_data_and_skew_the_labels_more_as_alpha_falls():
    from gleak.contracts.seeds import generator
    from gleak.mechanics.data import client_shards

    labels = torch.arange(1000) % 10
    skews = {}
    for alpha in (0.05, 1.0, 1000.0):
        per_seed = []
        for seed in range(5):
            shards = client_shards(labels, 8, generator(seed, "s"), alpha, min_size=5)
            together = torch.cat(shards)
            assert sorted(together.tolist()) == list(range(1000))  # every sample on exactly one client
            assert min(len(s) for s in shards) >= 5
            per_seed.append(_skew(shards, labels))
        skews[alpha] = per_seed
    # rates over seeds, not one draw: few classes per client at alpha 0.05, near IID (0.1 + noise) at 1000
    assert min(skews[0.05]) > 0.4 and max(skews[1000.0]) < 0.2
    assert sum(skews[0.05]) > sum(skews[1.0]) > sum(skews[1000.0])
    a = client_shards(labels, 8, generator(0, "s"), 0.5)
    b = client_shards(labels, 8, generator(0, "s"), 0.5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # a function of the generator alone
    with pytest.raises(InputError, match="dirichlet_alpha"):
        client_shards(labels, 8, generator(0, "s"), 0.0)


def test_published_utility_ids_are_unchanged_by_the_new_utility_key():
    """dirichlet_alpha left at None is not part of a utility run's id: the published runs stay valid."""
    import csv
    import json
    import tomllib
    from pathlib import Path

    from gleak.contracts import registry
    from gleak.contracts.config import UtilityConfig
    from gleak.orchestration.utility import utility_id

    root = Path(__file__).resolve().parent.parent
    raw = tomllib.loads((root / "suites" / "defense-costs.toml").read_text())["utility"]
    cfg = UtilityConfig.from_dict({**raw, "model_params": registry.check_params("model", raw["model"], raw.get("model_params", {}))})
    rows = list(csv.DictReader((root / "results" / "defense-costs" / "utility.csv").open()))
    assert len(rows) > 10
    for r in rows:
        assert utility_id(cfg, r["defense"], json.loads(r["defense_params"])) == r["utility_id"]
    skewed = UtilityConfig.from_dict({**cfg.to_dict(), "dirichlet_alpha": 0.5})
    assert utility_id(skewed, "none", {}) != utility_id(cfg, "none", {})


def test_utility_runs_train_on_dirichlet_shards_when_asked(tmp_path, utility_suite, monkeypatch):
    """[utility] dirichlet_alpha reaches the training loop's shards; a bad value is one line naming the key."""
    from gleak.mechanics import data
    from gleak.orchestration import utility
    from gleak.orchestration.suite import load_suite

    text = utility_suite.replace("clients = 2\n", "clients = 2\ndirichlet_alpha = 0.1\n")
    (tmp_path / "s.toml").write_text(text)
    cfg = load_suite(tmp_path / "s.toml").utility
    assert cfg.dirichlet_alpha == 0.1
    seen = []
    real = data.client_shards  # the training loop (gleak.mechanics.rounds.federated_training) deals the shards from here

    def spy(labels, clients, gen, alpha=None, min_size=1):
        shards = real(labels, clients, gen, alpha, min_size)
        seen.append((alpha, min_size, [len(s) for s in shards]))
        return shards

    monkeypatch.setattr(data, "client_shards", spy)
    train, test = utility.load_utility_data(cfg)
    out = utility.federated_training(cfg, gleak.create("protocol", "fedsgd"), ("none", {}), train, test)
    assert 0 <= out["accuracy"] <= 1
    assert seen[0][0] == 0.1 and seen[0][1] == cfg.batch_size and sum(seen[0][2]) == len(train)  # all samples dealt
    (tmp_path / "bad.toml").write_text(text.replace("dirichlet_alpha = 0.1", "dirichlet_alpha = 0.0"))
    with pytest.raises(InputError, match=r"\[utility\] key 'dirichlet_alpha': must be > 0"):
        load_suite(tmp_path / "bad.toml")


def test_the_embedded_crops_come_from_the_disk_cache_bit_for_bit_and_a_bad_entry_is_cut_again(tmp_path, monkeypatch):
    """Cached crops are the cut ones, bit for bit, at each size its own entry; an entry that is damaged, another
    size's or edited is cut again and replaced; a cache folder that cannot be written still gives the crops."""
    from gleak.mechanics import data, disk_cache

    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "cache"))
    cuts = []
    cut = data._cut_skimage_crops
    monkeypatch.setattr(data, "_cut_skimage_crops", lambda size: cuts.append(size) or cut(size))
    for size in (8, 12):
        want = cut(size)
        for _ in range(2):
            x, y = data._skimage_crops(size)
            assert torch.equal(x, want[0]) and torch.equal(y, want[1])
    assert cuts == [8, 12]  # once each: the second load of a size is read from its entry
    entries = {int(p.name.split("-")[1]): p for p in (tmp_path / "cache" / "data").glob("skimage-*.pt")}
    assert sorted(entries) == [8, 12]
    good = entries[8].read_bytes()
    saved = torch.load(entries[8], weights_only=True)
    edited = {**saved, "tensors": {**saved["tensors"], "x": saved["tensors"]["x"] * 0.5}}
    for damage in ("truncated", "another size's", "edited"):
        if damage == "truncated":
            entries[8].write_bytes(good[: len(good) // 2])
        elif damage == "another size's":
            entries[8].write_bytes(entries[12].read_bytes())
        else:
            torch.save(edited, entries[8])
        cuts.clear()
        x, _ = data._skimage_crops(8)
        assert cuts == [8] and torch.equal(x, cut(8)[0]), damage
        assert entries[8].read_bytes() == good, damage  # replaced by the whole entry
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(blocker))
    assert torch.equal(data._skimage_crops(8)[0], cut(8)[0])
