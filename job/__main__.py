from job.cli import main

main()
