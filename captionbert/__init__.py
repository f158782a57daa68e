"""A notebook-first research workbook for consensus distillation of text encoders

Modules:

- `captionbert.architecture`: The workbook's layering, read from its code: every module's imports of the workbook, by the notebook it is exported from. A module imports only modules numbered before it (no circle can form), a function-level import is the exception a comment explains, and `ARCHITECTURE.md`'s graph is generated here, so it cannot drift: `python -m captionbert.architecture --check` fails when the code breaks the order or the page differs from it.
- `captionbert.libraries`: What the workbook writes by hand, measured against what its libraries offer: the harness's Spearman against scipy, the covariances against `torch.cov`, the Wilson interval and the unit bootstrap against scipy, the retrieval metrics against pytrec_eval (mteb's backend), the pooling against sentence-transformers, the Procrustes fit and the whitening against scipy.linalg, the token store against datasets' cache, and the memory-mapped shard reader against safetensors'.
- `captionbert.loop`: The one training loop of the workbook: its config and schedule, the step (whole or in chunks), checkpoints and exact resume, and the consensus loss and gauges it is tested on. Every section that trains (05's recipe, 05a's timings, 06's arms, 08's trunks, 09's depth arm) trains through `train` here; 05_train is the consensus recipe and its plan on top of it."""

__version__ = "0.1.0"
