"""`batchrun sweep`: a dataset × a grid of settings → generations, scores, tables and a report."""
