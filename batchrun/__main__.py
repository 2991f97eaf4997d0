from batchrun.cli import main

main(prog_name="batchrun")
