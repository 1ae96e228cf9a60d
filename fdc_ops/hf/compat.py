"""Where transformers releases differ in what the model side reads, in one place: the tested range, enforced when
:mod:`fdc_ops.hf` is imported, and the names a cache travels under.

The compressed attention modules stand in for a decoder layer's own attention, so they receive what the decoder layer
passes; a release that renames an argument would otherwise leave them without their cache and every decode step
attending to its own token alone, with no error (transformers 5.24 renamed ``past_key_values`` to ``cache``). So the
modules take the cache under every name the supported releases use, refuse a cache they find under any other name,
and releases outside the tested range are refused on import (docs/design.md section 5 lists every transformers
internal the model side reads, with the release it was checked against and the test that fails when it changes).
"""

from __future__ import annotations

import inspect
import warnings

from .. import supported

#: The names a decoder layer passes its cache under: ``cache`` from transformers 5.24, ``past_key_values`` in 5.16.1
#: to 5.23 (and still accepted by 5.24's models, deprecated), ``past_key_value`` in older 4.x releases (outside the
#: supported range; read all the same, so a caller that still passes it is not missed).
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def check_transformers() -> None:
    """Refuses a transformers release outside :data:`fdc_ops.supported.TRANSFORMERS` (RuntimeError naming the
    version, the range and the opt-out variable); with the opt-out set, warns instead."""
    import transformers

    warning = supported.check("transformers", transformers.__version__, supported.TRANSFORMERS, "fdc_ops.hf")
    if warning is not None:
        warnings.warn(warning, RuntimeWarning, stacklevel=3)


def cache_argument(kwargs: dict, who: str):
    """The transformers cache in an attention module's keyword arguments ``kwargs``, under whichever name of
    :data:`CACHE_ARGUMENTS` the caller used, or None. Raises if two names carry a cache, or if a Cache arrives under
    a name not known here (a future rename), so it can never be silently missed."""
    from transformers.cache_utils import Cache

    given = [name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None]
    if len(given) > 1:
        raise ValueError(f"{who}: a cache was passed as both {given[0]} and {given[1]}; pass one")
    unknown = [name for name, value in kwargs.items() if name not in CACHE_ARGUMENTS and isinstance(value, Cache)]
    if unknown:
        raise RuntimeError(f"{who}: a transformers Cache arrived as {unknown[0]}=, a name the compressed attention "
                           f"does not know (it reads {', '.join(CACHE_ARGUMENTS)}): this transformers release passes "
                           f"the cache differently and is not supported")
    return kwargs[given[0]] if given else None


def cache_keyword(model) -> str:
    """The name under which ``model``'s forward() takes a cache: ``cache`` (transformers 5.24 and newer) or
    ``past_key_values``. For code that calls a model step by step: ``model(ids, **{cache_keyword(model): cache})``."""
    parameters = inspect.signature(model.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise TypeError(f"fdc_ops.hf: {type(model).__name__}.forward takes none of {', '.join(CACHE_ARGUMENTS)}")


def returned_cache(outputs):
    """The cache a model's forward returned (``outputs.cache`` from transformers 5.24, else
    ``outputs.past_key_values``)."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)
