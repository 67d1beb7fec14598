"""aie_lessons: the inference engine built in the aie course, one stage per module.

Stage modules (``weights``, ``tokenizer``, ``model``, ``sampling``, ``generate``, ...) and the
subpackages of later stages are *generated* from the solution sources in ``solutions/`` (or from
a learner's notebook by ``aie commit``); each names its stage in its header. Written by hand:
``cli``, ``infra`` (paths, environment, model files, GGUF conversion), ``course`` (the one-source
tools and grading) and ``checks`` (each exercise's check).
"""

__version__ = "0.1.0"
