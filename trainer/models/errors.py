"""The error every way of finding a model raises; its own module so that ``resolve`` (which calls the
builders) and the builders (``embedded``, which raises it too) both import it from below."""


class ModelNotFoundError(LookupError):
    """A model name that cannot be resolved; the message says what to do."""
