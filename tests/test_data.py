import pytest
import torch

from gleak.data import load_dataset, sample_indices
from gleak.errors import DatasetMissing, InputError


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
    from gleak.data import FASHION_MNIST_DEFAULT

    if not (FASHION_MNIST_DEFAULT / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("dataset-fashion-mnist is not installed (apt-get install -y dataset-fashion-mnist)")
    tr, te = load_dataset("fashion-mnist"), load_dataset("fashion-mnist", "test")
    assert tr.x.shape == (60000, 1, 28, 28) and te.x.shape == (10000, 1, 28, 28)
    assert torch.bincount(tr.y).tolist() == [6000] * 10


def test_image_folder(tmp_path):
    from PIL import Image
    import numpy as np

    for c in ("cats", "dogs"):
        (tmp_path / c).mkdir()
        for i in range(3):
            Image.fromarray((np.random.default_rng(i).random((40, 50, 3)) * 255).astype("uint8")).save(tmp_path / c / f"{i}.png")
    ds = load_dataset(f"folder:{tmp_path}")
    assert ds.classes == ("cats", "dogs") and ds.x.shape[1:] == (3, 32, 32)


def test_unknown_dataset_suggests():
    with pytest.raises(InputError, match="did you mean 'skimage'"):
        load_dataset("skimag")


def test_distinct_label_batches():
    ds = load_dataset("skimage")
    idx = sample_indices(len(ds), ds.y, 8, torch.Generator().manual_seed(0), distinct_labels=True)
    assert len(set(ds.y[idx].tolist())) == 8
