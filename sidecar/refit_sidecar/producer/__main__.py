"""`python -m refit_sidecar.producer --config FILE`: run one trainer sidecar in this process."""

from refit_sidecar.producer.main import main

if __name__ == "__main__":
    main()
