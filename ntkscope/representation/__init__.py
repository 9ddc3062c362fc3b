"""The representation stage: clustering estimators, layer separation, the CSE router fit and the plan, on
embedding arrays (docs/design.md §3, §4)."""
