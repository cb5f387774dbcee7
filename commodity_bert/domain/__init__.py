"""The domain path's own pieces (recipes/domain.sh): what joins data preparation and evaluation,
so it sits above both (docs/layout.md's layers): whether a task's dev texts appear in the text
meant for pretraining (`overlap`, `python -m commodity_bert.domain check-text`)."""
