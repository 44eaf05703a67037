"""Work units: the server's durable record of which samples are leased, trained and pending."""
