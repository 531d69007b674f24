import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Reward worker processes (spawn) and launched subprocesses import the test reward functions by path.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
