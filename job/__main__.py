from job.entry import main

main()
