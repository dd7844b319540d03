"""Layer 5, reporting: what is written from the stored results.

Aggregation and ranking (frames in, frames out), the claims, the documents (Markdown, HTML, CSV, LaTeX), the
figures, and `report`, which writes a folder's files. Nothing here runs a trial.
"""
