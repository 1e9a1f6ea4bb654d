"""mpt-report: every result record -> a tidy table, the paper's tables and figures."""
