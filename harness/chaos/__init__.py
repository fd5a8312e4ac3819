"""The kill -9 harness: ``python -m harness.chaos --cycles N`` (see ``__main__``)."""
