import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Shared test helpers (cfg_helpers.py) import by name from every test folder.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
