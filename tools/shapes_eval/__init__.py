"""ShapesEval: GenEval-style scoring of generated shapes images (see scorer.py).

    python -m tools.shapes_eval score --images DIR --prompts tools/shapes_eval/prompts.jsonl
"""

from tools.shapes_eval.scorer import (  # noqa: F401
    CATEGORIES,
    check,
    detect,
    format_table,
    load_prompts,
    score_dir,
    score_image,
    summarise,
)
