"""The offline judge: the ``offline`` annotator of CPU runs and CI (no network, no key, $0, deterministic).

Where to look:

* :mod:`.annotator` — the registered ``offline`` annotator (references, hard or weighted labels);
* :mod:`.judge` — :class:`~.judge.OfflineJudge`: a score per output, a verdict per pair;
* :mod:`.features` — the feature vector its linear head reads, built from
  :mod:`.text_features` (text statistics, n-gram fluency, key-word coverage), :mod:`.embeddings` (MiniLM) and
  :mod:`.language_model` (a small LM's reading of the output; its batched reads in :mod:`.token_logprobs`);
* :mod:`.vector_cache` — embeddings and LM readings kept on disk between runs (``cache_dir``);
* :mod:`.weights` — the weights file's format and fingerprint; ``weights.json`` holds the shipped weights.

The weights are fitted by a maintainer tool outside the package, ``python tools/fit_offline_judge.py --data
../shared/data --out FILE`` (it needs the recorded judgments in the shared data folder, which do not ship).
Nothing here imports it.
"""
