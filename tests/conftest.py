"""Shared pytest set-up: repo root importable; hypothesis profile for CI."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
