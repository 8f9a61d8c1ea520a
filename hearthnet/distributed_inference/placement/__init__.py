"""Automatic hosting (M26 §5.2): community facts, the range planner (Petals' "raise the
weakest layer") and the autohost loop that acts on the event log's coverage.
"""
