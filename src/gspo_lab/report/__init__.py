"""Reading run dirs, plots and tables."""
