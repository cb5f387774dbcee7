"""`bert-launch`: DeepSpeed's launcher with the signals passed on to the ranks and the checks a
multi-node start needs (`launcher`)."""
