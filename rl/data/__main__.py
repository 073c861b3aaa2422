"""`python -m rl.data convert SOURCE OUT_DIR --tokenizer DIR`: the token file converter (rl/data/token_file.py)."""

import sys

from rl.data.token_file import main

sys.exit(main())
