"""aie_lessons: the inference engine built in the aie course, one stage per module.

Stage modules (``weights``, ``tokenizer``, ``model``, ``generate``, ...) are *generated* from the
solution sources in ``solutions/`` (or from a learner's notebook by ``aie commit``); the other
modules (``paths``, ``model_files``, ``gguf_convert``, ``cli``, ``course``, ``checks``) are course
infrastructure written by hand.
"""

__version__ = "0.1.0"
