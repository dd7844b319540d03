"""The documents written from the aggregated frames (gleak.reporting.aggregate): the leaderboard as blocks (leaderboard), drawn
as Markdown (markdown) and as one HTML page (html); the CSV and LaTeX tables (tables); how a cell shows a value
(cells). gleak.reporting.report writes them into an output folder."""
