"""The kill -9 harness: ``python -m bench.chaos --cycles N`` (see ``__main__``)."""
