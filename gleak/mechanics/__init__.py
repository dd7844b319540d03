"""Layer 2, the mechanics: the computations a trial is made of.

Scoring, the round loop and the Protocol base class, the observation gate, models and their training, data sets,
the text modality (`gleak.mechanics.text`), secret sharing, atomic file writes. They import the contracts and each
other, never the plugins, the runner, the store or the report.
"""
