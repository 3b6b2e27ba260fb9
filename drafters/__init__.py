"""Drafters propose draft token trees for the target to verify."""
