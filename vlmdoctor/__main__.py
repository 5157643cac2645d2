from vlmdoctor.cli import main

if __name__ == "__main__":  # not when a worker process of the analyzer imports it
    main()
