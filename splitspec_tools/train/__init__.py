"""Training recipe for the default target model (GitHub issue 5).

`corpus` picks and splits the standard-library sources, `tokenizer` trains the byte-level BPE,
`target` trains the Qwen3-architecture model and writes the Hugging Face folder, and `evaluate`
measures it and writes the model card. `python -m splitspec_tools.train.target --help` for the CLI.
"""

import os as _os

# The machine may be shared with other jobs: OpenMP threads that spin while waiting for a
# descheduled sibling slow training several-fold, sleeping ones barely at all. Must be set
# before torch (and its OpenMP runtime) is first imported, hence here.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
