"""Placement: model layout + node descriptors → a plan. (Filled in by the planner issue.)"""
