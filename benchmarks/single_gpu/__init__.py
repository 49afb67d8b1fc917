"""One GPU: ODC's trainers against TRL's on one device, and the compute ceiling of the microbatch path."""
