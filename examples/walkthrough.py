# %% [markdown]
# # gleak from Python: one attack, one defense, a small suite, the frontier
#
# A percent-format script: run it as `python examples/walkthrough.py`, or open `examples/walkthrough.ipynb`, the
# same cells as a notebook with their outputs stored (generated from this file and executed by
# `python examples/execute_walkthrough.py`; VS Code, PyCharm and Spyder also run the `# %%` cells of this file). It writes into
# `$GLEAK_EXAMPLE_OUT` (default `walkthrough-out/` in the current folder) and takes about half a minute on one core.
# tests/test_examples.py runs it, so it cannot rot.

# %%
import os
from pathlib import Path

import gleak

try:  # in a notebook (examples/walkthrough.ipynb): the cells below show their figures
    get_ipython().run_line_magic("matplotlib", "inline")  # noqa: F821 - IPython's builtin
except NameError:  # run as a script: the figures are written to files
    pass

OUT = Path(os.environ.get("GLEAK_EXAMPLE_OUT", "walkthrough-out"))
OUT.mkdir(parents=True, exist_ok=True)
print(gleak.list_plugins("attack"))
print(gleak.list_plugins("defense"))

# %% [markdown]
# ## One attack through one defense
#
# `run_trial` takes the attack and the defense by name, or as a dict with parameters, and any key of a suite's
# `[case]` table. The trial is the one a suite with these tables would run: same defaults, same trial id, same
# numbers. The closed-form attack inverts the MLP's first linear layer; at batch size 1 and without a defense it is
# exact.

# %%
plain = gleak.run_trial(attack="closed-form", defense="none", dataset="skimage", model="mlp", batch_size=1, seed=0)
print(plain)
print(plain.trial_id, plain.truth.shape, plain.reconstruction.shape)

# %% [markdown]
# Top-k pruning sends only the largest 10% of the gradient's entries: the same attack now recovers a sparse,
# noisy picture. `plot()` returns a matplotlib figure, the true batch above its reconstruction.

# %%
pruned = gleak.run_trial(attack="closed-form", defense={"name": "topk", "ratio": 0.9}, batch_size=4, seed=0)
print(pruned.metrics)
fig = pruned.plot()
fig.savefig(OUT / "closed_form_vs_topk.png")
fig

# %% [markdown]
# ## A small suite
#
# A suite is a TOML file; `gleak.run` runs it exactly as `gleak run` does (validated first, each trial stored as it
# finishes, a rerun skips what is stored) and returns the counts, the folder and the rows. The `[utility]` table
# trains the model by federated learning under each defense, so that the leaderboard has accuracy next to leakage.

# %%
SUITE = """
[suite]
name = "walkthrough"
seeds = [0, 1]
save_images = false
[case]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [32] }
resolution = 16
batch_size = 2
[[attack]]
name = "closed-form"
[[attack]]
name = "idlg"
[[defense]]
name = "none"
[[defense]]
name = "noise"
sigma = [0.01, 0.1]
[[defense]]
name = "topk"
ratio = [0.5, 0.99]
[utility]
dataset = "skimage"
model = "mlp"
model_params = { hidden = [32] }
resolution = 16
clients = 2
training_rounds = 30
batch_size = 8
"""
(OUT / "walkthrough.toml").write_text(SUITE)
summary = gleak.run(OUT / "walkthrough.toml", out=OUT / "suite", workers=1, progress=False)
print(summary)
print(summary.leaderboard)

# %% [markdown]
# `gleak.results(DIR)` reads any output folder (the store, or results.csv of a published one) into a DataFrame
# with one column per plugin parameter, ready for pandas.

# %%
df = gleak.results(OUT / "suite")
cols = ["attack", "defense", "defense.sigma", "defense.ratio", "seed", "psnr", "label_acc"]
print(df[cols].to_string(max_rows=12))
print(df.groupby(["defense", "defense.sigma", "defense.ratio"], dropna=False)["psnr"].mean())

# %% [markdown]
# ## The privacy-utility frontier
#
# The run drew it into `figures/frontier.png`: each defense configuration's worst-case attack PSNR against its
# test accuracy. The numbers behind it are the leaderboard's.

# %%
import json  # noqa: E402

import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import imread  # noqa: E402

board = pd.read_csv(summary.out / "leaderboard.csv")
board["setting"] = [", ".join(f"{k}={v}" for k, v in json.loads(p).items() if k in ("sigma", "ratio")) for p in board["defense_params"]]
print(board[["rank", "defense", "setting", "worst_attack", "psnr", "accuracy"]].to_string(index=False))
frontier = Figure(figsize=(7, 5))
ax = frontier.subplots()
ax.imshow(imread(summary.out / "figures" / "frontier.png"))
ax.set_axis_off()
frontier
