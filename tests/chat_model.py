"""The tiny chat model and GSM8K-format data of scripts/make_chat_example.py, for tests."""

from scripts.make_chat_example import CHATML, EXTRA_ROWS, save_chat_model, word_problems, write_jsonl

__all__ = ["CHATML", "EXTRA_ROWS", "save_chat_model", "word_problems", "write_jsonl"]
