"""Accounting, statistics, stored results, reports and plots."""
